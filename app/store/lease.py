"""An instance's lease, renewed from a thread of its own (docs/design.md §11).

How this works: a :class:`LeaseKeeper` runs one thread with its own event loop and
its own asyncpg connection, and renews the bound instance's lease every third of its
TTL. Nothing of the gateway's stands in front of a renewal: not the pool that the
reads, recorded inputs and the tool ledger share (under a burst of new requests
they hold every connection of it), nor the gateway's event loop (thousands of held
streams delay each of its turns). Each answer is handed to the gateway's loop
(``on_answer``), which judges the lease on its own monotonic clock from the answered
renewal's send time, as before.

The thread renews only while the gateway's loop is alive: it posts a beat to that
loop several times a second, and a renewal is skipped when the last beat ran longer
ago than ``alive_within_s``. So a wedged loop (a blocking call, a busy-wait) still
loses its lease, in PostgreSQL as on its own clock; a stopped process (SIGSTOP)
stops this thread too.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import asyncpg

from app.store.instances import renew_lease

log = logging.getLogger("phasegate.instance")


@dataclass(frozen=True, slots=True)
class Renewal:
    """An answered renewal: ``live`` instances, or ``None`` when the lease was already lost."""

    instance_id: str
    sent_at: float  # on the keeper's monotonic clock, before the statement was sent
    live: int | None


class LeaseKeeper:
    """Renews ``bind``'s instance every ``ttl_s / 3`` from a thread with its own
    connection to ``dsn``; ``on_answer`` runs on the loop that called :meth:`start`."""

    def __init__(
        self,
        dsn: str,
        ttl_s: float,
        on_answer: Callable[[Renewal], None],
        *,
        alive_within_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.dsn = dsn
        self.ttl_s = ttl_s
        self.alive_within_s = ttl_s / 2 if alive_within_s is None else alive_within_s
        self.clock = clock  # stamps the renewals' send times, as the instance judges its lease
        self.last: Renewal | None = None  # the latest answered renewal (written by the thread)
        self._on_answer = on_answer
        self._instance_id: str | None = None
        self._beat = time.monotonic()  # when the gateway's loop last ran a beat (paces the thread too)
        self._gateway_loop: asyncio.AbstractEventLoop | None = None
        self._own_loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()

    def start(self) -> None:
        """Start the thread; call it on the gateway's loop."""
        self._gateway_loop = asyncio.get_running_loop()
        self._beat = time.monotonic()
        # in a copy of the caller's context: the thread's log lines name the instance, as its loop's do
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=context.run, args=(self._run,), name="instance lease", daemon=True)
        self._thread.start()
        self._started.wait()

    def bind(self, instance_id: str | None) -> None:
        """Renew ``instance_id`` from now on; ``None``: renew nothing (fenced)."""
        self._instance_id = instance_id

    async def stop(self) -> None:
        """End the thread (a renewal in flight is abandoned) and close its connection."""
        if self._thread is None or self._own_loop is None or self._stopping is None:
            return
        self._instance_id = None
        with contextlib.suppress(RuntimeError):  # its loop already ended
            self._own_loop.call_soon_threadsafe(self._stopping.set)
        await asyncio.to_thread(self._thread.join, 10.0)
        self._thread = None

    # --- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        asyncio.run(self._keep())

    async def _keep(self) -> None:
        self._own_loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        self._started.set()
        interval, tick = self.ttl_s / 3, min(0.25, self.ttl_s / 20)
        connection: asyncpg.Connection | None = None
        next_renewal = time.monotonic() + interval
        stalled = False
        try:
            while not self._stopping.is_set():
                self._post_beat()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), max(min(tick, next_renewal - time.monotonic()), 0))
                instance_id = self._instance_id
                if self._stopping.is_set() or time.monotonic() < next_renewal or instance_id is None:
                    continue
                next_renewal = time.monotonic() + interval
                silent = time.monotonic() - self._beat
                if silent > self.alive_within_s:
                    if not stalled:
                        log.error(
                            "gateway instance %s: its event loop ran nothing for %.1fs; lease not renewed",
                            instance_id,
                            silent,
                        )
                    stalled = True
                    continue
                stalled = False
                connection = await self._renew(connection, instance_id, interval)
        finally:
            if connection is not None:
                connection.terminate()

    async def _renew(
        self, connection: asyncpg.Connection | None, instance_id: str, timeout_s: float
    ) -> asyncpg.Connection | None:
        """One renewal; the connection to use next (``None`` after a failure: reconnect)."""
        sent_at = self.clock()
        try:
            async with asyncio.timeout(timeout_s):
                if connection is None or connection.is_closed():
                    connection = await asyncpg.connect(self.dsn)
                    sent_at = self.clock()  # the lease counts from the statement, not the connect
                live = await renew_lease(connection, instance_id, self.ttl_s)
        except Exception as exc:  # PostgreSQL away or slow: the lease runs on, then lapses
            log.warning("gateway instance %s: renewal failed: %r", instance_id, exc)
            if connection is not None:
                connection.terminate()  # its state is unknown after a timeout
            return None
        renewal = Renewal(instance_id, sent_at, live)
        self.last = renewal
        self._call_gateway(self._on_answer, renewal)
        return connection

    def _post_beat(self) -> None:
        self._call_gateway(self._beat_now)

    def _beat_now(self) -> None:
        self._beat = time.monotonic()

    def _call_gateway(self, callback: Callable[..., None], *args: object) -> None:
        assert self._gateway_loop is not None
        with contextlib.suppress(RuntimeError):  # the gateway's loop closed: nothing to tell
            self._gateway_loop.call_soon_threadsafe(callback, *args)
