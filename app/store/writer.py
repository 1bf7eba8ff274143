"""The group-commit writer: one ordered pipeline for every append of a store.

How this works: appends join one FIFO queue. One task takes a prefix of the queue
(at most ``max_batch_events`` events) and writes it in one statement, which is its
own transaction: one round trip and one WAL flush for the whole batch, the read
models projected by the trigger in the same transaction (:mod:`app.store.insert`
picks the statement: VALUES, unnest arrays or a binary COPY, by batch size). Raw
asyncpg, not SQLAlchemy, because this is the hot path: ``ops/bench/eventlog.py
--compare-core`` measures the same durable append through SQLAlchemy Core, which
costs markedly more (figures: docs/performance.md).

- A durable append is written at once (nothing lingers while one waits) and its
  caller resumes after the commit; whatever was queued ahead of it is committed in
  the same transaction or an earlier one, so a request's events land in seq order.
- With only non-durable appends queued, the writer lingers until the oldest is
  ``flush_delay`` old or a batch is full, so that many requests share one commit.
- A batch is at most ``max_batch_events`` events, few enough to fit in one socket
  send buffer on the wire (the sizes: docs/performance.md). A larger batch is
  sent over several event-loop turns, each one behind every task that is ready
  (under load, the producers of the next batch), so PostgreSQL waits for the rest
  of its data while Python works, and the two never overlap; within the buffer,
  PostgreSQL works while the producers build the next batch (``ops/bench/eventlog.py``
  measures the group-commit rate; figures: docs/performance.md).
- The queue is bounded (``max_queued_events``): appends wait for room.
- A batch that PostgreSQL rejects (a conflict; or a retried event, which COPY cannot
  skip) is written again with one savepoint per append and ``ON CONFLICT (event_id,
  accepted_on) DO NOTHING``, so retries are no-ops and only the offending appends fail. The
  request's appends already in the pipeline behind a failed one fail with it (they
  would follow someone else's events). A non-durable append's failure is raised by
  the request's next append; after that the request may append again.
- PostgreSQL unreachable: the durable appends waiting fail with ``StoreUnavailable``,
  non-durable ones stay queued (they were acknowledged), new appends fail fast, and
  the writer reconnects with backoff. Both edges are logged.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable

import asyncpg

from app.store.append_queue import AppendQueue
from app.store.errors import StoreError, StoreUnavailable, is_unavailable, rejection
from app.store.insert import LogSchema, insert_rows
from app.store.pending import Failures, PendingAppend

logger = logging.getLogger("phasegate.store.writer")

# What PostgreSQL, or asyncpg before sending, refuses about the rows themselves (a
# conflict, a value out of range): it fails the offending append, never the writer.
_REJECTIONS = (asyncpg.PostgresError, asyncpg.DataError)


class GroupCommitWriter(AppendQueue):
    """Writes appends in order, many per transaction; see the module docstring."""

    def __init__(
        self,
        dsn: str,
        *,
        flush_delay: float = 0.005,
        max_batch_events: int = 500,
        max_queued_events: int = 20_000,
        on_commit: Callable[[], None] | None = None,
        connect_timeout: float = 5.0,
        command_timeout: float = 60.0,
        reconnect_max_delay: float = 1.0,
        instance: str | None = None,
    ) -> None:
        self._dsn = dsn
        self._instance = instance  # the gateway instance whose lease guards every append
        self._bound_instance: str | None = None  # what the connection's session says now
        self._flush_delay = flush_delay
        self._max_batch_events = max_batch_events
        self._max_queued_events = max_queued_events
        self._on_commit = on_commit or (lambda: None)
        self._connect_timeout = connect_timeout
        self._command_timeout = command_timeout  # a hung connection is an outage, not a wait forever
        self._reconnect_max_delay = reconnect_max_delay
        self._conn: asyncpg.Connection | None = None
        self.schema = LogSchema()
        self._queue: collections.deque[PendingAppend] = collections.deque()
        self._queued_events = 0
        self._durable_queued = 0
        self._in_flight: list[PendingAppend] = []
        self._work = asyncio.Event()  # something is queued, or closing
        self._urgent = asyncio.Event()  # stop lingering: a durable append, a full batch, a flush
        self._room = asyncio.Event()  # the queue has room again
        self._held = False  # ``hold``: nothing is written until ``bind_instance``
        self._progress = asyncio.Event()  # a batch settled (flush() checks again)
        self._flushers = 0
        self._tickets = 0
        self._failures = Failures()
        self._unavailable: StoreError | None = None
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self.batches = 0  # committed transactions, for benchmarks and tests
        self.events = 0

    async def start(self) -> None:
        """Connect (raising ``StoreUnavailable`` if PostgreSQL is not there) and start."""
        try:
            self._conn = await self._connect()
        except Exception as exc:
            if is_unavailable(exc):
                raise StoreUnavailable(f"PostgreSQL is unreachable: {exc}") from exc
            raise
        self._task = asyncio.create_task(self._run(), name="phasegate-store-writer")

    async def _connect(self) -> asyncpg.Connection:
        self._bound_instance = None
        conn = await asyncpg.connect(self._dsn, timeout=self._connect_timeout, command_timeout=self._command_timeout)
        try:
            await self.schema.learn(conn)  # partitioned or not yet (a rolling upgrade): app/store/insert.py
        except BaseException:
            conn.terminate()  # never left open for the collector
            raise
        return conn

    def bind_instance(self, instance: str | None) -> None:
        """Append for ``instance`` from the next batch on: PostgreSQL refuses the
        appends while its lease is lapsed (``InstanceFenced``); ``None``: unguarded."""
        self._instance, self._held = instance, False
        self._work.set()  # a held writer writes what it kept, under ``instance`` now

    def hold(self) -> None:
        """Write nothing until the next :meth:`bind_instance` (the instance lost its lease): what
        is queued is written under the new id then; expected versions refuse what another wrote."""
        self._held = True

    async def close(self, timeout: float = 30.0) -> None:
        """Commit everything accepted, then disconnect; ``StoreUnavailable`` if that fails."""
        if self._closing:
            return
        self._closing = True
        for event in (self._work, self._urgent, self._room):
            event.set()
        try:
            if self._task is not None:
                await asyncio.wait_for(asyncio.shield(self._task), timeout)
        except TimeoutError:
            lost = self._queued_events + sum(len(entry.rows) for entry in self._in_flight)
            assert self._task is not None
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            logger.error("closing the event store: %d accepted events could not be written", lost)
            raise StoreUnavailable(f"{lost} accepted events could not be written before closing") from None
        finally:
            if self._conn is not None:
                self._conn.terminate()
                self._conn = None

    # --- the writer task ---------------------------------------------------------------

    async def _run(self) -> None:
        batch: list[PendingAppend] = []
        try:
            while self._queue or not self._closing:
                if not self._queue or (self._held and not self._closing):
                    self._work.clear()
                    await self._work.wait()
                    continue
                await self._linger()
                batch = self._in_flight = self._take_batch()
                try:
                    await self._write(batch)
                finally:
                    self._in_flight = []
                    self._progress.set()
        except Exception:
            # A bug, not an outage: say so loudly and stop taking appends rather
            # than leave callers waiting forever.
            logger.exception("the event store's writer stopped")
            self._unavailable = StoreError("the event store's writer stopped; see the log")
            for entry in (*batch, *self._queue):
                if entry.done is not None and not entry.done.done():
                    entry.done.set_exception(self._unavailable)
            self._queue.clear()
            self._progress.set()
            raise

    async def _linger(self) -> None:
        self._urgent.clear()
        if self._durable_queued or self._flushers or self._closing:
            return
        if self._queued_events >= self._max_batch_events:
            return
        loop = asyncio.get_running_loop()
        timer = loop.call_at(loop.time() + self._flush_delay, self._urgent.set)
        try:
            await self._urgent.wait()
        finally:
            timer.cancel()

    def _take_batch(self) -> list[PendingAppend]:
        batch: list[PendingAppend] = []
        events = 0
        while self._queue and (not batch or events + len(self._queue[0].rows) <= self._max_batch_events):
            entry = self._queue.popleft()
            batch.append(entry)
            events += len(entry.rows)
            if entry.durable:
                self._durable_queued -= 1
        self._queued_events -= events
        self._room.set()
        return batch

    async def _write(self, batch: list[PendingAppend]) -> None:
        writable = []
        for entry in batch:
            error = self._failures.behind(entry)
            if error is not None:
                self._settle(entry, error, behind_failure=True)
            else:
                writable.append(entry)
        if not writable:
            return
        rows = [row for entry in writable for row in entry.rows]
        try:
            try:
                if self._conn is None:
                    raise StoreUnavailable("not connected")
                if self._bound_instance != self._instance:  # once per connection or instance
                    await self._conn.execute("SELECT set_config('phasegate.instance', $1, false)", self._instance or "")
                    self._bound_instance = self._instance
                await insert_rows(self._conn, rows, copy=True, schema=self.schema)
            except _REJECTIONS as exc:
                if is_unavailable(exc):
                    raise
                await self._write_one_by_one(writable)
        except Exception as exc:
            if isinstance(exc, StoreUnavailable) or is_unavailable(exc) or self._conn.is_closed():  # type: ignore[union-attr]
                await self._outage(writable, exc)
                return
            raise
        self.batches += 1
        self.events += len(rows)
        for entry in writable:
            self._settle(entry, entry.error, behind_failure=entry.behind_failure)
        self._on_commit()

    async def _write_one_by_one(self, batch: list[PendingAppend]) -> None:
        """Write the batch with one savepoint per append, so that only bad appends fail."""
        assert self._conn is not None
        failed: dict[str, StoreError] = {}
        for entry in batch:
            entry.error, entry.behind_failure = None, False
        async with self._conn.transaction():
            for entry in batch:
                earlier = failed.get(entry.request_id)
                if earlier is not None:
                    entry.error, entry.behind_failure = earlier, True
                    continue
                try:
                    async with self._conn.transaction():
                        await insert_rows(self._conn, entry.rows, copy=False, schema=self.schema)
                except _REJECTIONS as exc:
                    if is_unavailable(exc):
                        raise
                    entry.error = rejection(entry.request_id, entry.expected_version, exc)
                    failed[entry.request_id] = entry.error

    def _settle(self, entry: PendingAppend, error: StoreError | None, *, behind_failure: bool = False) -> None:
        reported = entry.done is not None  # its caller sees the error
        if error is not None and not behind_failure:
            self._failures.add(entry.request_id, error, self._tickets, reported=reported)
            if not reported:
                logger.warning("a queued append of request %s failed: %s", entry.request_id, error)
        if entry.done is None or entry.done.done():
            return
        if error is None:
            entry.done.set_result(None)
        else:
            entry.done.set_exception(error)

    async def _outage(self, batch: list[PendingAppend], cause: BaseException) -> None:
        """PostgreSQL went away: fail durable appends, keep the rest, reconnect."""
        began = time.monotonic()
        error = StoreUnavailable(f"PostgreSQL is unreachable ({type(cause).__name__}: {cause}); reconnecting")
        self._unavailable = error
        for entry in (*batch, *self._queue):
            if entry.durable and entry.done is not None and not entry.done.done():
                entry.done.set_exception(error)
        kept = [entry for entry in batch if not entry.durable]
        self._queue = collections.deque(entry for entry in (*kept, *self._queue) if not entry.durable)
        self._in_flight = []  # what it held is back in the queue
        self._queued_events = sum(len(entry.rows) for entry in self._queue)
        self._durable_queued = 0
        self._room.set()  # appends waiting for room wake up and fail fast
        self._progress.set()
        logger.error(
            "PostgreSQL unavailable: %s: %s; %d queued events kept, appends fail until it returns",
            cause.__class__.__name__,
            cause,
            self._queued_events,
        )
        if self._conn is not None:
            self._conn.terminate()
            self._conn = None
        delay = 0.05
        while True:
            try:
                self._conn = await self._connect()
                break
            except Exception as exc:
                logger.debug("reconnecting to PostgreSQL: %s", exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self._reconnect_max_delay)
        self._unavailable = None
        logger.warning(
            "PostgreSQL available again after %.1f s; writing %d queued events",
            time.monotonic() - began,
            self._queued_events,
        )
