"""What the worker service uses of its engine, and nothing more: a typed protocol.

``tokenfleet.worker.engine.engine.Engine`` satisfies it (mypy checks that where the ``worker``
command builds the service); a test may pass any object that does. The values it returns are
the engine's own output types (``tokenfleet.worker.engine.outputs``), which import no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from tokenfleet.shared.priority import Priority
from tokenfleet.worker.engine.block_manager import CacheWatcher
from tokenfleet.worker.engine.outputs import EngineCapacity, RequestOutput, StepStats
from tokenfleet.worker.engine.request import SamplingParams


class EnginePort(Protocol):
    """The engine as the service drives it: requests in, one step at a time, outputs out."""

    @property
    def tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer (chat templates; the prompts of ``messages``)."""

    @property
    def max_model_len(self) -> int:
        """Prompt + output tokens per request at most (longer prompts are refused)."""

    @property
    def last_step_stats(self) -> StepStats:
        """The last step's stats (an empty ``StepStats`` before the first step)."""

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        priority: Priority = ...,
        arrival_time: float | None = None,
        resume_output_ids: Sequence[int] = (),
    ) -> None:
        """Queue a request; ``ValueError`` (or ``TypeError``) if the engine refuses it."""

    def abort(self, request_id: str) -> bool:
        """Stop a request now; the next ``step()`` reports it finished (once)."""

    def step(self) -> list[RequestOutput]:
        """Run one iteration; each request with new tokens or that finished, once."""

    def has_unfinished(self) -> bool:
        """Whether some request is not reported finished yet."""

    def capacity(self) -> EngineCapacity:
        """What the engine can take now (free sequence slots and KV blocks)."""

    def watch_prefix_cache(self, watcher: CacheWatcher | None) -> None:
        """Tell ``watcher`` what enters and leaves the prefix cache (routing's published
        summary); None stops it."""
