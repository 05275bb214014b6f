"""Sampling parameters: how a request's tokens are drawn, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tokenfleet.shared.errors import InvalidRequest
from tokenfleet.shared.schema.constraint import Constraint
from tokenfleet.shared.schema.fields import check_text, is_int

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_SEED = 2**63 - 1
MAX_TOP_LOGPROBS = 20  # OpenAI's bound


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample; validated on construction (``InvalidRequest`` names the field).

    ``temperature == 0`` means greedy; ``top_k == 0`` disables top-k; ``top_p`` is in (0, 1].
    ``max_tokens`` is checked against the fleet's limit by :meth:`check_limit`.
    ``structured``: what the output must match (None: free text). ``logprobs``: each token
    event carries the token's log-probability and the ``top_logprobs`` (0-20) most likely
    alternatives (log-softmax of the raw logits: docs/structured-outputs.md).
    The three are written by :meth:`to_dict` only when set, so a request that does not use them
    encodes as it did before they existed.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    structured: Constraint | None = None
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:  # noqa: C901, PLR0912 (one check per field, in order)
        if not is_int(self.max_tokens) or self.max_tokens <= 0:
            raise InvalidRequest(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise InvalidRequest(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise InvalidRequest(f"{name} must be finite, got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.temperature < 0:
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise InvalidRequest(f"top_k must be an integer >= 0 (0 disables), got {self.top_k!r}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise InvalidRequest(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if len(stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
        for s in stop:
            check_text("stop string", s)
            if not s or len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidRequest(
                    f"stop strings must be 1-{MAX_STOP_STRING_CHARS} characters, got {s!r}"
                )
        object.__setattr__(self, "stop", stop)
        ids = tuple(self.stop_token_ids)
        if not all(is_int(t) and t >= 0 for t in ids):
            raise InvalidRequest(f"stop_token_ids must be integers >= 0, got {list(ids)!r}")
        object.__setattr__(self, "stop_token_ids", ids)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequest(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if isinstance(self.structured, dict):
            object.__setattr__(self, "structured", Constraint.from_dict(self.structured))
        elif self.structured is not None and not isinstance(self.structured, Constraint):
            raise InvalidRequest("structured must be a Constraint", param="structured")
        if not isinstance(self.logprobs, bool):
            raise InvalidRequest(
                f"logprobs must be a bool, got {self.logprobs!r}", param="logprobs"
            )
        if not is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(
                f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got "
                f"{self.top_logprobs!r}",
                param="top_logprobs",
            )
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")

    def check_limit(self, max_tokens_limit: int) -> None:
        """Raise ``InvalidRequest`` if ``max_tokens`` exceeds the fleet's limit."""
        if self.max_tokens > max_tokens_limit:
            raise InvalidRequest(
                f"max_tokens {self.max_tokens} is above the limit of {max_tokens_limit}"
            )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        out: dict[str, Any] = {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": list(self.stop),
            "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos,
        }
        if self.structured is not None:
            out["structured"] = self.structured.to_dict()
        if self.logprobs:
            out["logprobs"] = True
            out["top_logprobs"] = self.top_logprobs
        return out

    @classmethod
    def from_dict(cls, data: Any) -> SamplingParams:
        """Inverse of :meth:`to_dict`; unknown keys are an ``InvalidRequest``."""
        if not isinstance(data, dict):
            raise InvalidRequest("sampling must be an object")
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise InvalidRequest(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
        return cls(**data)
