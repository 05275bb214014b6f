"""The HTTP gateway against the Python client, side by side on one fleet in one run.

One private redis-server, one ``tokenfleet worker`` (``--threads 1``; SmolLM2-135M-Instruct by
default) and one ``tokenfleet serve`` process (one uvicorn process). This process drives both
sides with asyncio: the ``python`` side submits with ``AsyncClient.submit`` and reads
``handle.stream()``; the ``gateway`` side POSTs ``/v1/completions`` with ``stream: true`` over
httpx and reads the SSE chunks. Same prompts, greedy, ``ignore_eos``, so both sides generate the
same number of tokens. Three measurements, each repeated ``--rounds`` times, alternating which
side goes first (the machine is shared: a pair measured close together is the fair comparison):

* ``stream``: ``--concurrency`` requests of ``--max-tokens`` tokens at once; throughput =
  tokens received / (last end - first submit), and the ratio gateway ÷ python. A third side,
  ``sdk``, streams the same requests through the official ``openai`` SDK (``AsyncOpenAI``),
  which is what users run: its errors are counted (must be 0), and so are its streams that
  outlived the gateway's keep-alive interval (``--keepalive-s``; set it below a stream's length
  to prove that keep-alives between token events do not break the SDK, issue 27).
* ``ttft``: ``--ttft-requests`` pairs of single requests one after another (an idle fleet),
  the same prompt through each side back to back, which side first alternating; TTFT = first
  token received - submit; p50 of each side, and the p50 of the pairs' differences (the fairer
  figure on a shared machine: a pair sees the same load).
* ``rate``: ``--rate-requests`` non-streaming requests of 1 token, ``--concurrency`` in flight
  at a time; requests per second through the gateway (one uvicorn process) and, for scale,
  through the Python client on the same fleet.

Run::

    .venv/bin/python benchmarks/bench_gateway.py                 # SmolLM2, a few minutes
    .venv/bin/python benchmarks/bench_gateway.py --model tiny --rounds 3
    .venv/bin/python benchmarks/bench_gateway.py --keepalive-s 0.5   # streams outlive keep-alives
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import httpx2  # the openai SDK 3.x is built on it
import openai
import orjson

from tokenfleet.producer import AsyncClient
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.devtools.bench_table import add_record_flag, record_figures
from tokenfleet.worker.devtools.local_fleet import LocalFleet
from tokenfleet.worker.devtools.local_redis import RedisServer, free_port

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import percentile

# its rows in benchmarks/RESULTS.md
HEADLINE_KEYS = ("gateway-throughput", "gateway-ttft", "gateway-sdk-keepalive")

PROMPTS = [
    "Explain what a message queue is.",
    "Write a haiku about autumn.",
    "List three uses of Redis.",
    "What is continuous batching?",
    "Describe a paged KV cache in one paragraph.",
    "Why do web apps use background workers?",
    "Give me a short story opening.",
    "Summarise the benefits of streaming responses.",
]


def start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    out = open(log, "wb")  # noqa: SIM115 - the child owns it
    return subprocess.Popen(args, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT)


def wait(check, what: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.1)


class Sides:
    """The two ways to submit the same request, each timed from submit to first / last token."""

    def __init__(
        self,
        client: AsyncClient,
        http: httpx.AsyncClient,
        sdk: openai.AsyncOpenAI,
        keepalive_s: float,
    ) -> None:
        self.client = client
        self.http = http
        self.sdk = sdk
        self.keepalive_s = keepalive_s
        self.sdk_errors: list[str] = []
        self.sdk_streams = 0  # streams through the SDK that ended
        self.sdk_outlived = 0  # ... whose tokens spanned more than one keep-alive interval

    async def python(self, prompt: str, max_tokens: int) -> tuple[float, float, int]:
        t0 = time.perf_counter()
        handle = await self.client.submit(
            prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True
        )
        first, n = 0.0, 0
        async for event in handle.stream():
            if getattr(event, "index", None) is not None:
                n += 1
                first = first or time.perf_counter() - t0
        return first, time.perf_counter() - t0, n

    async def gateway(self, prompt: str, max_tokens: int) -> tuple[float, float, int]:
        body = {
            "model": "default",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        t0 = time.perf_counter()
        first, n = 0.0, 0
        async with self.http.stream("POST", "/v1/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if line.startswith("id: "):
                    n += 1
                    first = first or time.perf_counter() - t0
        return first, time.perf_counter() - t0, n

    async def sdk_stream(self, prompt: str, max_tokens: int) -> tuple[float, float, int]:
        """The official SDK's stream; an exception it raises is counted, not propagated."""
        t0 = time.perf_counter()
        first, last, n = 0.0, 0.0, 0
        try:
            chunks = await self.sdk.completions.create(
                model="default",
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            async for chunk in chunks:
                if chunk.choices and chunk.choices[0].finish_reason is None:
                    n += 1
                    last = time.perf_counter() - t0
                    first = first or last
        except Exception as exc:  # what a user's app would see: counted and shown
            self.sdk_errors.append(f"{type(exc).__name__}: {exc}")
        self.sdk_streams += 1
        self.sdk_outlived += last - first > self.keepalive_s
        return first, time.perf_counter() - t0, n

    async def gateway_whole(self, prompt: str) -> None:
        body = {"model": "default", "prompt": prompt, "max_tokens": 1, "temperature": 0}
        resp = await self.http.post("/v1/completions", json=body)
        resp.raise_for_status()
        orjson.loads(resp.content)

    async def python_whole(self, prompt: str) -> None:
        handle = await self.client.submit(prompt, max_tokens=1, temperature=0)
        await handle.result()


async def stream_round(sides: Sides, side: str, n: int, max_tokens: int) -> float:
    fn = {"python": sides.python, "gateway": sides.gateway, "sdk": sides.sdk_stream}[side]
    t0 = time.perf_counter()
    results = await asyncio.gather(*(fn(PROMPTS[i % len(PROMPTS)], max_tokens) for i in range(n)))
    wall = time.perf_counter() - t0
    tokens = sum(r[2] for r in results)
    if side != "sdk":  # the SDK side counts its failures instead (shown at the end)
        assert tokens == n * max_tokens, (side, tokens)
    return tokens / wall


async def rate_round(sides: Sides, side: str, total: int, concurrency: int) -> float:
    fn = sides.python_whole if side == "python" else sides.gateway_whole
    queue = list(range(total))

    async def lane() -> None:
        while queue:
            i = queue.pop()
            await fn(PROMPTS[i % len(PROMPTS)])

    t0 = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(concurrency)))
    return total / (time.perf_counter() - t0)


async def measure(
    args: argparse.Namespace, redis_url: str, prefix: str, base_url: str
) -> dict[str, str]:
    settings = Settings(redis_url=redis_url, key_prefix=prefix)
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    pairs: list[float] = []  # gateway - python TTFT of one prompt, measured back to back
    async with (
        AsyncClient.from_url(settings=settings) as client,
        httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as http,
        httpx2.AsyncClient(timeout=600, limits=httpx2.Limits(max_connections=256)) as sdk_http,
    ):
        sdk = openai.AsyncOpenAI(
            base_url=f"{base_url}/v1", api_key="unused", max_retries=0, http_client=sdk_http
        )
        sides = Sides(client, http, sdk, args.keepalive_s)
        await sides.python("warm up", 4)
        await sides.gateway("warm up", 4)
        await sides.sdk_stream("warm up", 4)
        order = [("python", "gateway", "sdk"), ("sdk", "gateway", "python")]
        tput: dict[str, list[float]] = {"python": [], "gateway": [], "sdk": []}
        ttft: dict[str, list[float]] = {"python": [], "gateway": []}
        rate: dict[str, list[float]] = {"python": [], "gateway": []}
        for rnd in range(args.rounds):
            for side in order[rnd % 2]:
                tput[side].append(
                    await stream_round(sides, side, args.concurrency, args.max_tokens)
                )
            for i in range(args.ttft_requests):
                for side in order[(rnd + i) % 2]:
                    if side == "sdk":
                        continue  # TTFT compares the Python client with raw SSE only
                    fn = sides.python if side == "python" else sides.gateway
                    ttft[side].append((await fn(PROMPTS[i % len(PROMPTS)], 2))[0] * 1000)
                pairs.append(ttft["gateway"][-1] - ttft["python"][-1])
            for side in order[rnd % 2]:
                if side == "sdk":
                    continue
                rate[side].append(
                    await rate_round(sides, side, args.rate_requests, args.concurrency)
                )
            print(
                f"round {rnd + 1}: stream tok/s python {tput['python'][-1]:.1f} gateway "
                f"{tput['gateway'][-1]:.1f} sdk {tput['sdk'][-1]:.1f}; "
                f"non-stream req/s python {rate['python'][-1]:.1f} "
                f"gateway {rate['gateway'][-1]:.1f}",
                flush=True,
            )
    ratios = [g / p for g, p in zip(tput["gateway"], tput["python"], strict=True)]
    p50 = {s: percentile(v, 50) for s, v in ttft.items()}
    print()
    print(
        f"model {args.model}; worker --threads 1; one uvicorn process; {args.rounds} rounds; "
        f"keep-alive every {args.keepalive_s} s"
    )
    print(f"{'measure':<44}{'python':>10}{'gateway':>10}{'ratio/diff':>12}")
    print(
        f"{'stream throughput, tok/s (median of rounds)':<44}"
        f"{statistics.median(tput['python']):>10.1f}{statistics.median(tput['gateway']):>10.1f}"
        f"{statistics.median(ratios):>12.3f}"
    )
    print(f"{'  per round gateway ÷ python':<44}{'':>20}  {' '.join(f'{r:.3f}' for r in ratios)}")
    sdk_ratios = [g / p for g, p in zip(tput["sdk"], tput["python"], strict=True)]
    print(
        f"{'  openai SDK stream tok/s; ÷ python':<44}{'':>10}"
        f"{statistics.median(tput['sdk']):>10.1f}{statistics.median(sdk_ratios):>12.3f}"
    )
    print(
        f"{'  openai SDK streams: ended / errors':<44}{'':>10}"
        f"{sides.sdk_streams:>10}{len(sides.sdk_errors):>12}"
    )
    print(f"{'  ... whose tokens outlived one keep-alive':<44}{'':>10}{sides.sdk_outlived:>10}")
    for error in sides.sdk_errors[:5]:
        print(f"    SDK error: {error}")
    print(
        f"{'TTFT p50, ms (idle fleet)':<44}{p50['python']:>10.2f}{p50['gateway']:>10.2f}"
        f"{p50['gateway'] - p50['python']:>+12.2f}"
    )
    print(
        f"{'  TTFT paired difference p50 / p25 / p75, ms':<44}{'':>20}  "
        f"{percentile(pairs, 50):+.2f} / {percentile(pairs, 25):+.2f} / "
        f"{percentile(pairs, 75):+.2f}"
    )
    print(
        f"{'non-streaming requests/s (1 token)':<44}"
        f"{statistics.median(rate['python']):>10.1f}{statistics.median(rate['gateway']):>10.1f}"
        f"{statistics.median(rate['gateway']) / statistics.median(rate['python']):>12.3f}"
    )
    # the headline rows (benchmarks/RESULTS.md), each written by the command that measures it
    return {
        "gateway-throughput": f"{statistics.median(ratios):.3f} "
        f"(rounds {min(ratios):.3f}–{max(ratios):.3f})",
        "gateway-ttft": f"{p50['gateway'] - p50['python']:+.2f} ms "
        f"(paired p50 {percentile(pairs, 50):+.2f} ms)",
        "gateway-sdk-keepalive": f"{len(sides.sdk_errors)} of {sides.sdk_streams} "
        f"({sides.sdk_outlived} outlived it)",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 (default), tiny, or a path")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--ttft-requests", type=int, default=40)
    parser.add_argument("--rate-requests", type=int, default=200)
    parser.add_argument(
        "--keepalive-s", type=float, default=15.0, help="the gateway's SSE keep-alive interval"
    )
    add_record_flag(parser)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    model = args.model
    if model == "tiny":
        from tokenfleet.worker.devtools.tiny_model import make_tiny_model

        model = str(make_tiny_model(tmp / "tiny"))
    prefix = f"benchgw{uuid.uuid4().hex[:6]}"
    with RedisServer() as server:
        env = {"REDIS_URL": server.url, "TOKENFLEET_KEY_PREFIX": prefix}
        cli = [sys.executable, "-m", "tokenfleet.worker.cli"]
        fleet = LocalFleet(model, server.url, key_prefix=prefix, num_workers=1).start(300)
        port = free_port()
        serve = ["serve", "--port", str(port), "--log-level", "warning"]
        gateway = start(
            [*cli, *serve, "--keepalive-s", str(args.keepalive_s)],
            env,
            tmp / "gw.log",
        )
        try:

            def gateway_up() -> bool:
                try:
                    return httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
                except httpx.HTTPError:
                    return False

            wait(gateway_up, "the gateway")
            figures = asyncio.run(measure(args, server.url, prefix, f"http://127.0.0.1:{port}"))
        finally:
            gateway.terminate()
            gateway.wait(60)
            fleet.stop()
    if args.record:
        record_figures(figures, benchmarks=Path(__file__).parent, keys=HEADLINE_KEYS)


if __name__ == "__main__":
    main()
