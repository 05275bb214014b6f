"""``benchmarks/bench_vs_llamacpp.py``'s own parts, without llama.cpp or a fleet: the traces, the
load's turns, the figures and the goals' arithmetic, the build's and the server's commands."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from tokenfleet.worker.devtools.commands.bench import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_vs_llamacpp.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script(SCRIPT)


def test_a_trace_is_the_same_for_the_same_level_and_seed(bench: ModuleType) -> None:
    assert bench.make_trace(8, 32, seed=3) == bench.make_trace(8, 32, seed=3)
    assert bench.make_trace(8, 32, seed=3) != bench.make_trace(8, 32, seed=4)


def test_every_level_gets_prompts_of_its_own(bench: ModuleType) -> None:
    traces = {level: bench.make_trace(level, 32) for level in (1, 8, 32)}
    prompts = [req.prompt for trace in traces.values() for req in trace]
    assert len(set(prompts)) == len(prompts) == 96


def test_a_trace_draws_lengths_in_their_ranges(bench: ModuleType) -> None:
    trace = bench.make_trace(32, 200, seed=1)
    lows, highs = bench.PROMPT_WORDS
    words = [len(req.prompt.split()) for req in trace]
    assert all(lows <= n - 8 <= highs for n in words)  # tag (2) and instruction (6) around
    assert {req.max_tokens for req in trace} <= set(range(16, 129))
    assert min(r.max_tokens for r in trace) < 40 and max(r.max_tokens for r in trace) > 100
    with pytest.raises(ValueError, match="must be >= 0"):
        bench.make_trace(-1, 4)


class FakeClient:
    """An ``AsyncOpenAI`` stand-in: streams ``max_tokens`` one-word chunks, then the usage, and
    records each request's prompt."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.prompts: list[str] = []
        self.fail_on = fail_on
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))
        self.closed = 0

    def connect(self) -> FakeClient:
        """A client for one run: this one again (closed afterwards), so it sees every request."""
        return self

    async def close(self) -> None:
        self.closed += 1

    async def create(self, **body: Any) -> Any:
        prompt = body["messages"][0]["content"]
        self.prompts.append(prompt)
        assert body["stream"] and body["temperature"] == 0 and body["extra_body"]["ignore_eos"]
        if self.fail_on is not None and self.fail_on in prompt:
            raise RuntimeError("server said no")
        n = body["max_tokens"]

        async def chunks() -> Any:
            for _ in range(n):
                await asyncio.sleep(0)
                delta = SimpleNamespace(content="a")
                yield SimpleNamespace(choices=[SimpleNamespace(delta=delta)], usage=None)
            usage = SimpleNamespace(completion_tokens=n, prompt_tokens=150)
            yield SimpleNamespace(choices=[], usage=usage)

        return chunks()


def test_both_servers_get_each_levels_trace_and_no_level_another_ones(bench: ModuleType) -> None:
    clients = {name: FakeClient() for name in bench.SERVERS}
    connect = {name: client.connect for name, client in clients.items()}
    figures = asyncio.run(bench.measure(connect, [1, 8, 32], 8, seed=5))
    # each run (warm-up, then one per level) on a client of its own, closed after it
    assert [client.closed for client in clients.values()] == [4, 4]
    ours, theirs = (clients[name].prompts for name in bench.SERVERS)
    assert ours == theirs  # warm-up and levels alike, in the same order
    warmup, levels = ours[:4], ours[4:]
    for i, level in enumerate((1, 8, 32)):
        sent = levels[8 * i : 8 * (i + 1)]
        assert sorted(sent) == sorted(req.prompt for req in bench.make_trace(level, 8, seed=5))
    assert len(set(ours)) == len(ours) == 4 + 24 and not set(warmup) & set(levels)
    for (server, level), fig in figures.items():
        assert fig.num_errors == fig.num_short == 0, (server, level)
        assert fig.output_tokens == sum(r.max_tokens for r in bench.make_trace(level, 8, seed=5))


def test_a_failed_request_is_counted_not_hidden(bench: ModuleType) -> None:
    trace = bench.make_trace(8, 8)
    client = FakeClient(fail_on=trace[3].prompt)
    results, _wall = asyncio.run(bench.run_level(client, "default", trace, 8))
    assert [r.error is not None for r in results] == [i == 3 for i in range(8)]
    fig = bench.summarize("x", 8, results, 2.0, 0.0)
    assert fig.num_errors == 1 and fig.num_requests == 8
    assert fig.output_tokens == sum(req.max_tokens for i, req in enumerate(trace) if i != 3)


def _result(bench: ModuleType, ttft: float, decode: float, n: int, max_tokens: int) -> Any:
    return bench.RequestResult(ttft, decode, n, 100, max_tokens)


def test_figures_from_requests(bench: ModuleType) -> None:
    results = [
        _result(bench, 1.0, 0.9, 10, 10),  # 100 ms a token after the first
        _result(bench, 3.0, 0.6, 31, 32),  # 20 ms a token; one short of its max_tokens
        _result(bench, 2.0, 0.0, 1, 1),  # one token: no time per token
    ]
    fig = bench.summarize("ours", 1, results, 4.2, 1.5)
    assert fig.output_tokens == 42 and fig.tok_s == pytest.approx(10.0)
    assert fig.tpot_ms == pytest.approx(60.0)
    assert fig.ttft_p50_s == pytest.approx(2.0)
    assert fig.ttft_p99_s == pytest.approx(2.98)
    assert fig.num_short == 1 and fig.mean_prompt_tokens == 100 and fig.load_avg_1m == 1.5


def _fig(bench: ModuleType, server: str, level: int, **values: float) -> Any:
    base = {"tok_s": 10.0, "tpot_ms": 50.0, "ttft_p50_s": 1.0, "ttft_p99_s": 2.0}
    counts = {"num_requests": 32, "num_errors": 0, "num_short": 0, "output_tokens": 100}
    rest = {"mean_prompt_tokens": 150.0, "wall_s": 10.0, "load_avg_1m": 0.0}
    return bench.LevelFigures(server, level, **counts, **rest, **{**base, **values})


def test_ratios_and_goals(bench: ModuleType) -> None:
    ours, theirs = bench.OURS, bench.THEIRS
    figures = {
        (ours, 1): _fig(bench, ours, 1, tpot_ms=20.0),
        (theirs, 1): _fig(bench, theirs, 1, tpot_ms=25.0),
        (ours, 8): _fig(bench, ours, 8, tok_s=20.0),
        (theirs, 8): _fig(bench, theirs, 8, tok_s=16.0),
        (ours, 32): _fig(bench, ours, 32, tok_s=40.0, ttft_p50_s=5.0),
        (theirs, 32): _fig(bench, theirs, 32, tok_s=16.0, ttft_p50_s=40.0),
    }
    r = bench.ratios(figures[ours, 32], figures[theirs, 32])
    assert r["tok_s"] == pytest.approx(2.5) and r["ttft_p50_s"] == pytest.approx(0.125)
    verdicts = {g.text: (ratio, met) for g, ratio, met in bench.goal_verdicts(figures)}
    assert verdicts == {
        "tpot_ms at 1 ≤ 1×": (pytest.approx(0.8), True),
        "tok_s at 8 ≥ 1.5×": (pytest.approx(1.25), False),
        "tok_s at 32 ≥ 2×": (pytest.approx(2.5), True),
        "ttft_p50_s at 32 ≤ 0.25×": (pytest.approx(0.125), True),
    }
    # a level that was not run has no verdict; a zero on their side is no ratio, not a crash
    del figures[ours, 8]
    assert len(bench.goal_verdicts(figures)) == 3
    assert math.isnan(bench.ratios(figures[ours, 1], _fig(bench, theirs, 1, tok_s=0.0))["tok_s"])
    text = bench.table(figures)
    assert "ours÷them" in text and len(text.splitlines()) == 1 + 3 + 1 + 3
    cells = bench.headline_cells(figures)
    assert cells == {
        "llamacpp-http-1": "0.80 (20 against 25 ms a token)",
        "llamacpp-http-32": "2.50 / 0.12 (40.0 against 16.0 tok/s; TTFT p50 5.0 against 40.0 s)",
    }


def test_the_build_always_bounds_its_jobs(bench: ModuleType) -> None:
    env = bench.build_env(2)
    assert env["LLAMA_CPP_BUILD_JOBS"] == env["CMAKE_BUILD_PARALLEL_LEVEL"] == "2"
    assert "-DLLAMA_BUILD_TESTS=OFF" in env["CMAKE_ARGS"]


def test_llama_server_gets_our_threads_and_room(bench: ModuleType) -> None:
    args = bench.llama_server_args(Path("/x/llama-server"), Path("/m.gguf"), 8080, 1, 32, 512)
    flags = dict(zip(args[1::2], args[2::2], strict=False))
    assert flags["--threads"] == flags["--threads-batch"] == "1"
    assert flags["--parallel"] == "32" and flags["--ctx-size"] == str(32 * 512)
    assert "--cont-batching" in args and flags["--model"] == "/m.gguf"


def test_a_levels_counters_are_what_its_probe_counted_over_it(bench: ModuleType) -> None:
    readings = iter(range(100))

    def probe() -> dict[str, float]:  # counters that grow by a known step at each reading
        n = next(readings)
        steps = {"engine step s": 0.5 * n, "engine steps": 10.0 * n}
        return {"cpu worker": 2.0 * n, "cpu client": 1.0 * n, **steps}

    connect = {name: FakeClient().connect for name in bench.SERVERS}
    figures = asyncio.run(bench.measure(connect, [1, 8], 4, 0, {bench.OURS: probe}))
    ours, theirs = figures[bench.OURS, 8], figures[bench.THEIRS, 8]
    assert ours.counters == {
        "cpu worker": 2.0,
        "cpu client": 1.0,
        "engine step s": 0.5,
        "engine steps": 10.0,
    }
    # the load generator's CPU is not the server's
    assert ours.server_cpu_ms_per_token == pytest.approx(2000 / ours.output_tokens)
    assert ours.engine_step_ms == pytest.approx(50.0)
    assert theirs.counters == {} and math.isnan(theirs.server_cpu_ms_per_token)
    assert math.isnan(theirs.engine_step_ms)
    lines = bench.cost_table(figures).splitlines()
    assert "worker" in lines[0] and "client" in lines[0] and len(lines) == 1 + 4 + 2
    assert lines[3].split() == ["1", "ours÷them", "nan"]  # no CPU counted on their side
    assert lines[2].split()[:2] == ["1", bench.OURS] and lines[2].endswith("%")
