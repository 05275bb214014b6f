"""Seeded synthetic workloads for benchmarks: Poisson arrivals, mixed prompt and output lengths.

Plain functions returning dataclasses, no engine import, so the engine benchmark and the worker's
end-to-end benchmark replay exactly the same requests::

    wl = make_workload(64, vocab_size=len(tokenizer), rate_per_s=20.0, seed=0)
    for req in wl.requests: ...   # req.arrival_s, req.prompt_token_ids, req.max_tokens
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(slots=True, frozen=True)
class WorkloadRequest:
    request_id: str
    arrival_s: float  # seconds after the workload starts
    prompt_token_ids: tuple[int, ...]
    max_tokens: int  # output tokens to generate (run with ignore_eos to get exactly this many)
    priority: str = "normal"  # critical | normal | batch


@dataclass(slots=True)
class Workload:
    requests: list[WorkloadRequest] = field(default_factory=list)  # in arrival order
    rate_per_s: float = 0.0  # mean arrival rate of the Poisson process
    seed: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    @property
    def duration_s(self) -> float:
        """Arrival time of the last request."""
        return self.requests[-1].arrival_s if self.requests else 0.0


def make_workload(
    num_requests: int = 64,
    *,
    vocab_size: int,
    rate_per_s: float = 20.0,
    prompt_tokens: tuple[int, int] = (16, 256),
    max_tokens: tuple[int, int] = (8, 256),
    priorities: dict[str, float] | None = None,
    first_token_id: int = 5,
    seed: int = 0,
) -> Workload:
    """``num_requests`` requests with exponential inter-arrival times (mean ``1 / rate_per_s``),
    prompt lengths and max_tokens uniform in the given inclusive ranges, prompt tokens uniform in
    ``[first_token_id, vocab_size)`` (skip special ids), priorities drawn with the given weights
    (default: all normal). Same arguments → same workload."""
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not rate_per_s > 0:
        raise ValueError(f"rate_per_s must be > 0, got {rate_per_s}")
    for name, (lo, hi) in (("prompt_tokens", prompt_tokens), ("max_tokens", max_tokens)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} must be a range 1 <= lo <= hi, got {(lo, hi)}")
    if not 0 <= first_token_id < vocab_size:
        raise ValueError(f"first_token_id {first_token_id} outside the vocabulary {vocab_size}")
    rng = random.Random(seed)
    names, weights = zip(*(priorities or {"normal": 1.0}).items(), strict=True)
    t = 0.0
    requests = []
    for i in range(num_requests):
        t += rng.expovariate(rate_per_s)
        n = rng.randint(*prompt_tokens)
        requests.append(
            WorkloadRequest(
                request_id=f"req-{i:04d}",
                arrival_s=t,
                prompt_token_ids=tuple(rng.randrange(first_token_id, vocab_size) for _ in range(n)),
                max_tokens=rng.randint(*max_tokens),
                priority=rng.choices(names, weights)[0],
            )
        )
    return Workload(requests=requests, rate_per_s=rate_per_s, seed=seed)


CHAT_TEXT = (
    "Our team runs a small online bookshop and wants to send every customer a short, friendly "
    "note when an order ships. The note should name the book, say when it will arrive, and "
    "thank them without sounding like a template. Some customers order several books at once, "
    "some order gifts for other people, and a few live abroad where delivery takes weeks. We "
    "also want a version for delayed orders that apologises and offers a discount code. Please "
    "suggest wording for each case, keep every note under eighty words, avoid exclamation "
    "marks, and explain briefly why each choice of words works for that customer."
)


def chat_workload(
    num_requests: int,
    *,
    tokenizer: object,
    rate_per_s: float,
    prompt_tokens: tuple[int, int] = (10, 200),
    max_tokens: tuple[int, int] = (16, 128),
    seed: int = 0,
) -> Workload:
    """Like :func:`make_workload`, but each prompt is a real chat turn through the tokenizer's
    chat template: the user's text (a prefix of ``CHAT_TEXT``, cut at a token) is as long as
    the drawn prompt length allows after the template's own tokens, so prompt lengths still
    follow ``prompt_tokens`` (never below the template's overhead plus one token)."""
    base = make_workload(
        num_requests,
        vocab_size=2,
        rate_per_s=rate_per_s,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        first_token_id=0,
        seed=seed,
    )
    encode = tokenizer.encode  # type: ignore[attr-defined]
    text_ids = encode(CHAT_TEXT, add_special_tokens=False)
    template = tokenizer.apply_chat_template  # type: ignore[attr-defined]
    marker = "\x00"
    rendered = template(
        [{"role": "user", "content": marker}], tokenize=False, add_generation_prompt=True
    )
    head, tail = rendered.split(marker)
    head_ids = encode(head, add_special_tokens=False)
    tail_ids = encode(tail, add_special_tokens=False)
    requests = []
    for req in base.requests:
        room = max(1, len(req.prompt_token_ids) - len(head_ids) - len(tail_ids))
        body = (text_ids * (room // len(text_ids) + 1))[:room]
        ids = tuple(head_ids + body + tail_ids)
        requests.append(
            WorkloadRequest(req.request_id, req.arrival_s, ids, req.max_tokens, req.priority)
        )
    return Workload(requests=requests, rate_per_s=rate_per_s, seed=seed)


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
