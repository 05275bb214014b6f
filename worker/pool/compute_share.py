"""A pool member's pace under a compute share (issue 6): at most its share of tokens per round.

Workers co-located on one device compete for its compute, and the device (a GPU's time slicing,
the OS scheduler on a CPU) splits time evenly between processes, not by weight. A pool created
with ``--token-budget B --round-ms R`` says the device computes about ``B`` tokens per ``R`` ms;
the pool's script splits ``B`` by weight among the members that want tokens (water-filled, so a
member wanting less than its share leaves the rest to the others). :class:`ComputeShare` holds a
member to its share ``s``: a token bucket that refills at ``s`` tokens per ``R`` ms and holds at
most ``s``. Before each step the worker waits until the bucket holds the tokens the step wants (at
most ``s``), and the step computes no more than the bucket holds; so over any stretch of time a
member computes at most ``s`` tokens per round plus one round's burst, and the device's time goes
to the members by weight. Pacing only ever waits: set the budget to the device's real rate, or
the members leave it idle.

Invariants:
    * the level stays at most ``capacity`` (one round's share); a step's cap is at least 1, so
      work always progresses even with a share of 0 tokens (the level then goes into debt,
      repaid by waiting);
    * with no compute share in the pool (``share is None``) nothing is paced or capped.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable


class ComputeShare:
    """Token bucket for one member's share of a pool's token budget.

    Keyword-only arguments: ``token_budget`` (the pool's tokens per round), ``round_ms``,
    ``clock`` (monotonic seconds), ``sleep`` (seconds; injected for tests).
    """

    def __init__(
        self,
        *,
        token_budget: int,
        round_ms: int,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {token_budget}")
        if round_ms < 1:
            raise ValueError(f"round_ms must be >= 1, got {round_ms}")
        self.token_budget = token_budget
        self.round_s = round_ms / 1000
        self.clock = clock
        self.sleep = sleep
        self.share = 0  # tokens per round the pool granted at its last reply
        self.capacity = self._first_guess(0)  # tokens per round this member paces to
        self.level = float(self.capacity)  # tokens it may compute now
        self._at = clock()
        self.waited_s = 0.0  # total time spent waiting for the bucket

    def _first_guess(self, active_members: int) -> int:
        # A member that asked for nothing last round has a share of 0 while it now has work:
        # until its demand is counted, pace it as one more equal member.
        return max(1, self.token_budget // (active_members + 1))

    def set_share(self, share: int | None, active_members: int) -> None:
        """Take the share from the pool's reply (``PoolGrant.token_budget``)."""
        self._refill()
        self.share = share or 0
        self.capacity = self.share if self.share > 0 else self._first_guess(active_members)
        self.level = min(self.level, float(self.capacity))

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(
            float(self.capacity), self.level + (now - self._at) * self.capacity / self.round_s
        )
        self._at = now

    def pace(self, tokens_wanted: int) -> int:
        """Wait until the bucket holds what the next step wants (at most one round's share);
        returns the step's token cap (at least 1)."""
        self._refill()
        want = min(max(1, tokens_wanted), self.capacity)
        if self.level < want:
            wait = (want - self.level) * self.round_s / self.capacity
            self.sleep(wait)
            self.waited_s += wait
            self._refill()
        return max(1, math.floor(self.level + 1e-9))

    def spent(self, num_tokens: int) -> None:
        """Charge a step's computed tokens."""
        self._refill()
        self.level -= num_tokens

    def demand(self, tokens_wanted: int) -> int:
        """Tokens wanted per round, reported to the pool: the whole budget while the engine has
        work, else 0; the split then goes by weight among the members with work, and idle
        members donate theirs.

        Why not an estimate of use: an engine with work steps back to back, so it occupies the
        shared device whatever its batch size, and on a shared device its own throughput says
        how the device was shared, not what it needs (measured: reporting use plus headroom
        let the light member of a 1 : 3 pair take half the core)."""
        return self.token_budget if tokens_wanted > 0 else 0
