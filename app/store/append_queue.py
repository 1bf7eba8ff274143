"""The group-commit writer's queue side (app/store/writer.py): appends accepted in order,
waiting for room in a bounded queue, each with a ticket and, where tracked, a future that
settles at its commit; ``flush`` waits for every ticket so far. The writer's task takes
batches from the front (:class:`~app.store.writer.GroupCommitWriter`)."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence

from app.store.codec import EventRow
from app.store.errors import StoreClosed, StoreError
from app.store.pending import Failures, PendingAppend


class AppendQueue:
    """What callers of the writer do: queue appends and wait for their commits, over the
    state the writer holds (set up by :class:`~app.store.writer.GroupCommitWriter`)."""

    _max_batch_events: int
    _max_queued_events: int
    _queue: collections.deque[PendingAppend]
    _queued_events: int
    _durable_queued: int
    _in_flight: list[PendingAppend]
    _work: asyncio.Event  # something is queued, or closing
    _urgent: asyncio.Event  # stop lingering: a durable append, a full batch, a flush
    _room: asyncio.Event  # the queue has room again
    _progress: asyncio.Event  # a batch settled (flush() checks again)
    _flushers: int
    _tickets: int
    _failures: Failures
    _unavailable: StoreError | None
    _closing: bool

    @property
    def available(self) -> bool:
        return self._unavailable is None

    @property
    def queued_events(self) -> int:
        """Events accepted and not yet taken into a transaction."""
        return self._queued_events

    async def submit(self, request_id: str, expected_version: int, rows: Sequence[EventRow], durable: bool) -> None:
        """Queue an append; a durable one returns after its commit."""
        done = await self.enqueue(request_id, expected_version, rows, durable=durable, track=durable)
        if done is not None:
            # A cancelled caller cancels only its wait (``done``): its events stay in
            # the pipeline, where later appends may already depend on them, and are
            # written as queued (``_settle`` skips a future already done). Awaited
            # directly, not through ``asyncio.shield``: that costs an event-loop turn.
            await done

    async def enqueue(
        self, request_id: str, expected_version: int, rows: Sequence[EventRow], *, durable: bool, track: bool
    ) -> asyncio.Future[None] | None:
        """Queue an append and return once it is queued; with ``track``, a future that
        settles when it is committed (or failed). A tracked group-committed append waits
        through an outage, still queued, like any other that is not durable."""
        while True:
            self._check_accepting(request_id)
            if self._has_room(len(rows)):
                return self._put(request_id, expected_version, rows, durable=durable, track=track)
            self._room.clear()
            await self._room.wait()

    def enqueue_now(
        self, request_id: str, expected_version: int, rows: Sequence[EventRow]
    ) -> asyncio.Future[None] | None:
        """:meth:`enqueue` of a tracked group-committed append in the caller's own step,
        where that needs no wait: the future that settles at its commit, or ``None``
        when the queue has no room for it now (then nothing was queued)."""
        self._check_accepting(request_id)
        if not self._has_room(len(rows)):
            return None
        return self._put(request_id, expected_version, rows, durable=False, track=True)

    def _has_room(self, events: int) -> bool:
        return self._queued_events == 0 or self._queued_events + events <= self._max_queued_events

    def _put(
        self, request_id: str, expected_version: int, rows: Sequence[EventRow], *, durable: bool, track: bool
    ) -> asyncio.Future[None] | None:
        self._tickets += 1
        done = asyncio.get_running_loop().create_future() if track else None
        self._queue.append(PendingAppend(request_id, expected_version, rows, self._tickets, durable, done))
        self._queued_events += len(rows)
        self._work.set()
        if durable:
            self._durable_queued += 1
        if durable or self._queued_events >= self._max_batch_events:
            self._urgent.set()
        return done

    async def flush(self) -> None:
        """Wait until everything submitted so far is committed (or failed)."""
        target = self._tickets
        self._flushers += 1
        self._urgent.set()
        try:
            # The queue and the batch in flight are in ticket order (an outage puts
            # the kept appends back at the front), so their heads tell.
            while (self._in_flight and self._in_flight[0].ticket <= target) or (
                self._queue and self._queue[0].ticket <= target
            ):
                self._progress.clear()
                await self._progress.wait()
        finally:
            self._flushers -= 1

    def _check_accepting(self, request_id: str) -> None:
        if self._closing:
            raise StoreClosed("the event store is closed")
        if self._unavailable is not None:
            raise self._unavailable
        self._failures.check(request_id)
