"""A request's side of the log: build each event, fold it in, append it in order.

How this works: ``record`` stamps an event with the next seq and the wall clock,
applies it to the request's state at once (an illegal event raises here, before
anything is written) and queues it. ``flush`` hands the queue to the store, awaited
(``durable=True``) for the commit point and terminal events, group-committed
otherwise. Deliveries are coalesced: consecutive deltas of one attempt become one
``DeltasDelivered`` of up to ``delivery_batch_tokens`` deltas or
``delivery_batch_ms`` old, cut early by any other event so the log's order is the
order things happened.

Deliveries reach the log while the stream runs (docs/design.md §11): a batch that closes
(full, or aged by a timer) is appended at once, group-committed and never awaited on
the per-token path, and while one append of the request is on its way to the commit
the next batch waits for it. Where the store can take it without a wait, a closed
batch is queued in the step that closed it and its commit observed by a callback; a
task does it only where it must wait (a flush of the request under way, the writer's
queue full, a store that cannot queue in one step). While one batch commits and the
next is closed and waiting, the HTTP layer sends nothing more (``behind``,
``until_the_log_moves``), so the log is behind what the client received by at most two
batches and never ahead of it, however slow the commits get under load.

Appends run shielded (:mod:`app.driver.shielded`): a client that disconnects
mid-append cancels the HTTP task, not the append. While PostgreSQL is down, a durable flush retries for
``store_outage_grace_s`` before it gives up; the events stay queued either way and
the next flush retries them, so nothing recorded is dropped. A group-committed
flush that meets an outage leaves its events queued and returns.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime
from typing import Any

from app.driver.batches import OpenBatch
from app.driver.context import GatewayContext
from app.driver.outputs import Delta
from app.driver.shielded import begun, shielded
from app.store.errors import StoreError, StoreUnavailable
from statemachine.events import TERMINAL_EVENTS, DeltasDelivered, Event, FirstDeltaCommitted
from statemachine.request_state import RequestState
from statemachine.state import advance

log = logging.getLogger("phasegate.driver")

STORE_OUTAGE_GRACE_S = 10.0


class Recorder:
    def __init__(self, ctx: GatewayContext, state: RequestState, *, content_policy: str | None = None) -> None:
        """Record onward from ``state``: a new request's, or what the log already holds.
        ``content_policy``: what its content events keep, where stricter than the
        gateway's (a response's ``store: false``)."""
        self.ctx = ctx
        self.state = state
        self.content_policy = content_policy or ctx.config.content_policy
        self.appended_version = state.seq
        self._queued: list[Event] = []
        self._lock = asyncio.Lock()
        self._batch: OpenBatch | None = None  # deliveries not yet recorded as one event
        self._appending: asyncio.Future[None] | None = None  # closed batches on their way to the log
        self._batches_waiting = 0  # closed delivery batches queued behind the one on its way
        self._log_moved = asyncio.Event()  # an append of this request committed
        self._sealed = False  # the log was lost: nothing more is recorded (seal())
        # Batches go to the log as they close once the commit point is durable; a whole
        # answer's deliveries go with its completion instead, in the same append.
        self.appending_deliveries = False

    @property
    def request_id(self) -> str:
        return self.state.request_id

    # --- building events -------------------------------------------------------------

    def record(self, cls: type[Event], **fields: Any) -> Event | None:
        """Stamp, apply and queue one event, and return it; an open delivery batch is
        closed first. Nothing, once sealed (the log was lost: the request is closed from
        the log)."""
        if self._sealed:
            log.debug("request %s: %s not recorded: the request is sealed", self.request_id, cls.__name__)
            return None
        self.close_batch()
        return self._queue(cls, fields)

    def _queue(self, cls: type[Event], fields: dict[str, Any], occurred_at: datetime | None = None) -> Event:
        self.state, event = advance(self.state, cls, occurred_at or self.ctx.wall_clock(), **fields)
        self._queued.append(event)
        self.ctx.tracing.recorded(self.state, event)
        return event

    def delivered(self, attempt: int, lease_epoch: int, delta: Delta) -> None:
        """One delta written to the client, with its tokens' log probabilities (and ids)
        when asked for; recorded in batches."""
        self._add(attempt, lease_epoch, delta, produced=False)

    def produced(self, attempt: int, lease_epoch: int, delta: Delta) -> None:
        """One delta produced while no client is attached; recorded in batches, as produced."""
        self._add(attempt, lease_epoch, delta, produced=True)

    def _add(self, attempt: int, lease_epoch: int, delta: Delta, *, produced: bool) -> None:
        if self._sealed:
            return
        batch = self._batch
        if batch is not None and (batch.attempt != attempt or batch.produced != produced):
            self.close_batch()
            batch = None
        config = self.ctx.config
        if batch is None:
            state = self.state
            start = state.produced_deltas if produced else state.delivered_deltas
            batch = self._batch = OpenBatch(
                attempt, lease_epoch, start, self.ctx.clock(), self.ctx.wall_clock(), produced=produced
            )
            self.ctx.batch_ages.watch(self.batch_aged, batch, config.delivery_batch_ms / 1000)
        batch.add(delta)
        if batch.deltas >= config.delivery_batch_tokens or (
            self.ctx.clock() - batch.opened_at >= config.delivery_batch_ms / 1000
        ):
            self.close_batch()
            self._append_deliveries(produced)

    def batch_aged(self, batch: OpenBatch) -> None:
        """The batch is old (app/driver/batch_ages.py): a stream that pauses still gets
        its deliveries recorded."""
        if self._batch is batch:
            self.close_batch()
            self._append_deliveries(batch.produced)

    def _append_deliveries(self, produced: bool = False) -> None:
        """Append what is queued, group-committed, in the background; if an append of the
        request is still on its way, it takes what queued meanwhile once it committed.
        Produced output goes to the log as it is recorded, before any commit point too."""
        if self._appending is None and (self.appending_deliveries or produced):
            self._append_queued()

    def _append_queued(self) -> None:
        """Queue what is queued here for a group commit in this step where the store
        takes it without a wait (no append of the request under way, the writer has
        room), its commit observed by :meth:`_committed`; else in a task that waits."""
        if not self._lock.locked():  # (else a flush of the request holds it: the task waits behind it)
            events = list(self._queued)
            try:
                committed = self.ctx.store.append_grouped_now(self.request_id, self.appended_version, events)
            except StoreUnavailable:
                return  # still queued here: the next flush takes them along
            except StoreError as exc:  # a conflict: the request's next append conflicts too
                log.warning("request %s: recording deliveries failed: %s", self.request_id, exc)
                return
            if committed is not None:
                self._taken(len(events))
                self.appended_version += len(events)
                self._appending = committed
                committed.add_done_callback(self._committed)
                return
        self._appending = self.ctx.spawn(self._append_grouped(), name=f"deliveries {self.request_id}")

    def _committed(self, committed: asyncio.Future[None]) -> None:
        """An append queued by :meth:`_append_queued` settled: the next one may go."""
        self._appending = None
        self._log_moved.set()
        exc = committed.exception() if not committed.cancelled() else None
        if exc is not None:
            log.warning("request %s: recording deliveries failed: %s", self.request_id, exc)
        elif self._queued:  # what closed meanwhile, as the task takes it
            self._append_queued()

    async def _append_grouped(self) -> None:
        try:
            while True:
                async with self._lock:
                    if not self._queued:
                        return
                    events = list(self._queued)
                    try:
                        committed = await self.ctx.store.append_grouped(self.request_id, self.appended_version, events)
                    except StoreUnavailable:
                        return  # still queued here: the next flush takes them along
                    self._taken(len(events))
                    self.appended_version += len(events)
                await committed
                self._log_moved.set()
        except StoreError as exc:  # a conflict: the request's next append conflicts too
            log.warning("request %s: recording deliveries failed: %s", self.request_id, exc)
        finally:
            self._appending = None
            self._log_moved.set()

    def _taken(self, count: int) -> None:
        """The first ``count`` queued events went to the store."""
        del self._queued[:count]
        self._batches_waiting = sum(1 for event in self._queued if type(event) is DeltasDelivered)
        self._log_moved.set()

    def deliveries_before_a_batch_closes(self) -> int:
        """How many deltas may be delivered before ``behind`` must be asked again: the
        last of them may close the open batch, none before it (at least one)."""
        batch, config = self._batch, self.ctx.config
        if batch is None or batch.produced:
            return config.delivery_batch_tokens
        if self.ctx.clock() - batch.opened_at >= config.delivery_batch_ms / 1000:
            return 1  # aged: the next delta closes it
        return max(1, config.delivery_batch_tokens - batch.deltas)

    @property
    def behind(self) -> bool:
        """Two batches of deliveries are on their way to the log (one committing, one
        waiting for it): deliver no more until the log moves."""
        return self._batches_waiting > 0 and self._appending is not None

    async def until_the_log_moves(self) -> None:
        """Wait until fewer than two batches are on their way; :class:`StoreUnavailable`
        if the log takes none for ``STORE_OUTAGE_GRACE_S`` (as a durable append would)."""
        try:
            async with asyncio.timeout(STORE_OUTAGE_GRACE_S):
                while self.behind:
                    self._log_moved.clear()
                    await self._log_moved.wait()
        except TimeoutError:
            raise StoreUnavailable(f"the log took no delivery of request {self.request_id} in time") from None

    def close_batch(self) -> None:
        """Record the open delivery batch now (before an event that must count it)."""
        batch, self._batch = self._batch, None
        if batch is None:
            return
        cls, fields = batch.event(self.content_policy)
        # stamped when its first delta was written (any other event closes a batch first,
        # so the log's times still only move forward)
        self._queue(cls, fields, occurred_at=batch.first_at)
        if not batch.produced:
            self._batches_waiting += 1

    def seal(self, *, output_delivered: bool) -> None:
        """The log stopped taking this request's events and its client was told it failed
        (app/driver/log_loss.py): keep of the queue only what the client saw happen, and
        record nothing more. A queued terminal event goes (the client was told otherwise),
        and so does the commit point when nothing of the answer reached the client; what
        was delivered stays, to be appended once the log is back. Later events (a fence's
        bookkeeping) are dropped: the request is closed from the log instead."""
        self.close_batch()
        kept = []
        for event in self._queued:
            if type(event) in TERMINAL_EVENTS:
                break
            if not output_delivered and isinstance(event, FirstDeltaCommitted):
                break
            kept.append(event)
        self._queued = kept
        self._sealed = True

    @property
    def delivered_output_tokens(self) -> int:
        """Tokens written to the client so far, the open batch included."""
        batch = self._batch
        open_batch = batch.tokens if batch is not None and not batch.produced else 0
        return self.state.delivered_output_tokens + open_batch

    @property
    def delivered_deltas(self) -> int:
        """Deltas written to the client so far, the open batch included."""
        batch = self._batch
        open_batch = batch.deltas if batch is not None and not batch.produced else 0
        return self.state.delivered_deltas + open_batch

    @property
    def recorded_deltas(self) -> int:
        """Deltas of the current attempt recorded, delivered or produced, the open batch included."""
        batch = self._batch
        open_batch = batch.deltas if batch is not None else 0
        base = self.state.produced_deltas if batch is None else batch.from_index
        return max(self.state.produced_deltas, base + open_batch, self.delivered_deltas)

    @property
    def sealed(self) -> bool:
        """The log was lost: nothing more is recorded."""
        return self._sealed

    def append_in_background(self) -> None:
        """Append what is queued now, group-committed, not awaited (a disconnect, a resume)."""
        self._append_deliveries(True)

    @property
    def has_unflushed(self) -> bool:
        return bool(self._queued) or self._batch is not None

    # --- appending -------------------------------------------------------------------

    async def flush(self, *, durable: bool, close_batch: bool = True) -> None:
        """Append everything queued; with ``durable`` wait for the commit."""
        if close_batch:
            self.close_batch()
        if self._queued:
            await shielded(self._append(durable))

    def begin_durable_flush(self) -> asyncio.Future[None]:
        """``flush(durable=True)`` begun in this step (:func:`begun`: the append queued
        to the store where it can be), its commit a future to await through
        ``asyncio.shield``."""
        self.close_batch()
        return begun(self._append(True))

    async def flush_shielded_already(self) -> None:
        """``flush(durable=True)`` for a caller that runs shielded itself (the request's end)."""
        self.close_batch()
        if self._queued:
            await self._append(True)

    async def _append(self, durable: bool) -> None:
        async with self._lock:
            deadline = self.ctx.clock() + (STORE_OUTAGE_GRACE_S if durable else 0.0)
            delay = 0.05
            while self._queued:
                events = list(self._queued)
                started = self.ctx.clock()
                try:
                    version = await self.ctx.store.append(
                        self.request_id, self.appended_version, events, durable=durable
                    )
                except StoreUnavailable:
                    if not durable:
                        return  # still queued here: the next flush takes them along
                    if self.ctx.clock() + delay > deadline:
                        raise
                    log.warning("event log unavailable; request %s retries its append", self.request_id)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 1.0)
                    continue
                self.ctx.metrics.append_seconds.labels(durable=str(durable).lower()).observe(self.ctx.clock() - started)
                self._taken(len(events))
                self.appended_version = version
