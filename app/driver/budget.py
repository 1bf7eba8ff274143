"""The global retry budget: a token bucket shared by every request of the gateway.

A mass failure of replicas must not turn into a storm of re-prefills. Every retry
(an attempt after the first) takes a token; the bucket holds ``burst`` tokens and
refills at ``per_second``. A refused retry is recorded as ``RetryBudgetDenied`` and
the policy ends that request with a retryable error. The clock is injected.

The budget is for all gateway instances together: each instance holds its share,
``1 / live instances``, which its heartbeat refreshes (``share_among``), so the hot
path takes tokens without a round trip (docs/design.md §11).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class RetryBudget:
    def __init__(self, burst: int, per_second: float, clock: Callable[[], float] = time.monotonic) -> None:
        if burst < 0 or per_second < 0:
            raise ValueError("the retry budget must not be negative")
        self.burst = burst
        self.per_second = per_second
        self.clock = clock
        self.share = 1.0  # of the budget that all live instances hold together
        self._tokens = float(burst)
        self._at = clock()

    def share_among(self, instances: int) -> None:
        """Hold ``1 / instances`` of the budget from now on."""
        self.available  # noqa: B018 - refill at the old rate up to now
        self.share = 1.0 / max(instances, 1)
        self._tokens = min(self._tokens, self.burst * self.share)

    @property
    def available(self) -> float:
        now = self.clock()
        self._tokens = min(self.burst * self.share, self._tokens + (now - self._at) * self.per_second * self.share)
        self._at = now
        return self._tokens

    def try_take(self) -> bool:
        if self.available >= 1.0:
            self._tokens -= 1.0
            return True
        return False
