"""How a gateway process hears of fleet changes: LISTEN/NOTIFY on a connection of its own.

Why LISTEN/NOTIFY and not a follower polling ``fleet_events``: the notification is sent
by the projection trigger inside the transaction that writes the event (migration 0013),
and PostgreSQL delivers it to every listening session the moment that transaction
commits, in commit order, with no query of ours in between: every gateway process
learns of a change within milliseconds, and an idle fleet costs nothing. Its one
weakness is that it is lossy across a lost connection: a notification sent while a
listener was reconnecting is never delivered. So the listener reports every
(re)connection as a change too, and its keeper (app/driver/fleet.py) re-reads the whole
membership then, and every few seconds anyway: a missed notification delays a change
by at most that, never loses it.

The same connection may hold the fleet's session-level advisory lock
(``pg_try_advisory_lock``): the one process holding it reconciles the declared sources.
It is released when the connection ends, by a clean stop or the process's death, and
another process takes it at its next try.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import asyncpg

log = logging.getLogger("phasegate.fleet")

CHANNEL = "phasegate_fleet"
LEADER_LOCK = 0x70686173_666C64  # "phasfld": held by the process that reconciles declared sources


class FleetListener:
    """LISTENs on ``phasegate_fleet`` over its own connection to ``dsn``; ``on_change`` runs
    on each notification and after each (re)connection."""

    def __init__(self, dsn: str, on_change: Callable[[], None]) -> None:
        self.dsn = dsn
        self._on_change = on_change
        self._connection: asyncpg.Connection | None = None
        self.leading = False
        self._unreachable = False

    @property
    def connected(self) -> bool:
        return self._connection is not None and not self._connection.is_closed()

    async def ensure(self) -> bool:
        """Connected and listening (reconnecting if it was lost): whether it is."""
        if self.connected:
            return True
        await self._drop()
        try:
            connection = await asyncpg.connect(self.dsn, timeout=5)
        except (OSError, asyncpg.PostgresError, TimeoutError) as exc:
            if not self._unreachable:  # once an outage
                log.warning("fleet: cannot listen for changes (%r); membership is read again once it can", exc)
            self._unreachable = True
            return False
        try:
            await connection.add_listener(CHANNEL, self._notified)
        except BaseException:
            await connection.close()
            raise
        self._connection = connection
        self._unreachable = False
        self._on_change()  # whatever was sent while nobody listened: read it all again
        return True

    async def try_lead(self) -> bool:
        """Whether this process holds the fleet's advisory lock (taking it if free)."""
        if not await self.ensure():
            self.leading = False
            return False
        if not self.leading:
            assert self._connection is not None
            try:
                self.leading = bool(await self._connection.fetchval("SELECT pg_try_advisory_lock($1)", LEADER_LOCK))
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                log.warning("fleet: cannot try the fleet's lock: %r", exc)
                await self._drop()
        return self.leading

    async def close(self) -> None:
        await self._drop()

    def _notified(self, connection: Any, pid: int, channel: str, payload: object) -> None:
        self._on_change()

    async def _drop(self) -> None:
        connection, self._connection = self._connection, None
        self.leading = False  # a session lock ends with its session
        if connection is not None and not connection.is_closed():
            try:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(connection.close(), 5)
            finally:  # a close that failed, timed out or was cancelled: at once, never left open
                if not connection.is_closed():
                    connection.terminate()
