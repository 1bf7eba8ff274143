"""One timer a gateway for the age of every open delivery batch.

A request's open batch of deliveries (app/driver/recorder.py) is recorded once it is
``delivery_batch_ms`` old even when no delta comes to close it: a stream that pauses
still gets what it delivered into the log. Every batch of a gateway has the same age
limit (its configuration's), so their deadlines fall due in the order the batches
opened: a queue, and one timer for its head. Most batches close before their deadline
(a later delta finds them old, or another event cuts them), and their entries are
dropped when they come due. A ``call_later`` a batch made a timer handle, a push on the
loop's heap and a callback of the loop for each, several times what the queue costs
(``python ops/bench/studies/batch_ages.py``; figures: docs/performance.md).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any


class BatchAges:
    """The deadlines of open delivery batches, in the order they opened."""

    def __init__(self) -> None:
        self._due: deque[tuple[float, Callable[[Any], None], Any]] = deque()
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the timer's
        self._armed_for = 0.0  # the loop time the timer fires at: its head's deadline

    def watch(self, aged: Callable[[Any], None], batch: Any, age_s: float) -> None:
        """Call ``aged(batch)`` ``age_s`` from now (it records the batch if it is still
        open); ``age_s`` is the same for every batch (the gateway's ``delivery_batch_ms``)."""
        loop = asyncio.get_running_loop()
        due = loop.time() + age_s
        self._due.append((due, aged, batch))
        if self._timer is None or self._loop is not loop:  # (a test's gateway on a new loop)
            self._arm(loop, self._due[0][0])

    def _arm(self, loop: asyncio.AbstractEventLoop, due: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._loop, self._armed_for = loop, due
        self._timer = loop.call_at(due, self._fire)

    def _fire(self) -> None:
        """Every deadline passed, oldest first; then the timer again for the next."""
        self._timer = None
        loop = asyncio.get_running_loop()
        passed, due = max(loop.time(), self._armed_for), self._due
        try:
            while due and due[0][0] <= passed:
                _, aged, batch = due.popleft()
                aged(batch)
        finally:  # (a callback that raised is the loop's to report; the others still age)
            if due:
                self._arm(loop, due[0][0])

    def __len__(self) -> int:
        return len(self._due)
