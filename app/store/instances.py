"""Gateway instances in PostgreSQL (docs/design.md §11): register, renew, release, sweep.

Each ``phasegate serve`` process is one row of ``gateway_instances`` (migration
0004) with a lease. Renewing returns how many instances are live, which the
instances use to share the global retry budget. A live instance claims lapsed ones
with ``FOR UPDATE SKIP LOCKED``, so each is taken over by one sweeper however many
look at once; a claim whose sweeper itself lapsed may be taken again. An instance
that registers again under a new id (fenced: its lease lapsed) takes its old id over in
the same transaction, unless a live sweeper already holds it: only that process knows
what the old id's clients were told. The lease's clock is PostgreSQL's ``now()``: the
appends that the lease guards are judged by it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import text

from app.store.postgres import PostgresEventStore

_LIVE = "lease_expires_at > now() AND swept_by IS NULL AND released_at IS NULL"

_REGISTER = text(
    """
    INSERT INTO gateway_instances
        (instance_id, name, host, pid, version, address, lease_ttl_ms, lease_expires_at)
    VALUES (:instance_id, :name, :host, :pid, :version, :address, CAST(:ttl_ms AS integer),
            now() + CAST(:ttl_ms AS integer) * interval '1 millisecond')
    """
)


_RENEW = f"""
    WITH renewed AS (
        UPDATE gateway_instances SET lease_expires_at = now() + CAST($2 AS integer) * interval '1 millisecond'
         WHERE instance_id = $1::text AND {_LIVE}
        RETURNING instance_id)
    SELECT (SELECT count(*) FROM renewed) AS renewed,
           (SELECT count(*) FROM gateway_instances WHERE {_LIVE}) AS live
    """


async def renew_lease(connection: Any, instance_id: str, ttl_s: float) -> int | None:
    """Extend ``instance_id``'s lease by ``ttl_s`` from now, on a raw asyncpg connection:
    the number of live instances, or ``None`` when the lease is already lost (lapsed,
    swept or released). The lease keeper's renewals (app/store/lease.py) run it."""
    row = await connection.fetchrow(_RENEW, instance_id, round(ttl_s * 1000))
    return int(row["live"]) if row["renewed"] else None


_RELEASE = text("UPDATE gateway_instances SET released_at = now() WHERE instance_id = :instance_id")
_CLAIM = text(
    """
    UPDATE gateway_instances SET swept_by = :sweeper, sweep_started_at = now()
     WHERE instance_id IN (
        SELECT instance_id FROM gateway_instances AS lapsed
         WHERE lease_expires_at <= now() AND swept_at IS NULL AND released_at IS NULL
           AND (swept_by IS NULL OR NOT EXISTS (
                SELECT 1 FROM gateway_instances AS sweeper
                 WHERE sweeper.instance_id = lapsed.swept_by AND sweeper.lease_expires_at > now()
                   AND sweeper.released_at IS NULL AND sweeper.swept_by IS NULL))
         ORDER BY lease_expires_at
         LIMIT :limit
           FOR UPDATE SKIP LOCKED)
    RETURNING instance_id
    """
)
_TAKE_OVER = text(
    """
    UPDATE gateway_instances AS old SET swept_by = :sweeper, sweep_started_at = now()
     WHERE old.instance_id = :old AND old.swept_at IS NULL AND old.released_at IS NULL
       AND (old.swept_by IS NULL OR NOT EXISTS (
            SELECT 1 FROM gateway_instances AS sweeper
             WHERE sweeper.instance_id = old.swept_by AND sweeper.lease_expires_at > now()
               AND sweeper.released_at IS NULL AND sweeper.swept_by IS NULL))
    RETURNING instance_id
    """
)
_SWEPT = text(
    "UPDATE gateway_instances SET swept_at = now(), requests_swept = :closed"
    " WHERE instance_id = :instance_id AND swept_by = :sweeper"
)
_LIST = text(
    f"""
    SELECT instance_id, name, host, pid, version, address, started_at, lease_expires_at,
           released_at, swept_by, swept_at, requests_swept, ({_LIVE}) AS live
      FROM gateway_instances ORDER BY started_at DESC LIMIT :limit
    """
)


@dataclass(frozen=True, slots=True)
class InstanceInfo:
    """What an instance says of itself when it registers."""

    instance_id: str
    name: str
    host: str
    pid: int
    version: str
    address: str | None


class InstanceRegistry:
    """The ``gateway_instances`` table, over a store's connection pool."""

    def __init__(self, store: PostgresEventStore) -> None:
        self._store = store

    async def register(self, info: InstanceInfo, ttl_s: float, *, taking_over: str | None = None) -> bool:
        """Register ``info``; with ``taking_over`` (the id this process held before), claim
        that one for the new id in the same transaction, lapsed or not (it writes nothing
        more once claimed), unless a live sweeper holds it. Whether it was claimed."""
        async with self._store.writing() as connection:
            await connection.execute(
                _REGISTER,
                {
                    "instance_id": info.instance_id,
                    "name": info.name,
                    "host": info.host,
                    "pid": info.pid,
                    "version": info.version,
                    "address": info.address,
                    "ttl_ms": round(ttl_s * 1000),
                },
            )
            if taking_over is None:
                return False
            rows = await connection.execute(_TAKE_OVER, {"old": taking_over, "sweeper": info.instance_id})
            return bool(list(rows))

    async def release(self, instance_id: str) -> None:
        async with self._store.writing() as connection:
            await connection.execute(_RELEASE, {"instance_id": instance_id})

    async def claim_lapsed(self, sweeper: str, limit: int = 8) -> list[str]:
        """Lapsed instances that nobody live is sweeping, now claimed by ``sweeper``."""
        async with self._store.writing() as connection:
            rows = await connection.execute(_CLAIM, {"sweeper": sweeper, "limit": limit})
            return [row.instance_id for row in rows]

    async def swept(self, instance_id: str, sweeper: str, closed: int) -> None:
        """The sweep of ``instance_id`` is done: ``closed`` of its requests were open."""
        async with self._store.writing() as connection:
            await connection.execute(_SWEPT, {"instance_id": instance_id, "sweeper": sweeper, "closed": closed})

    async def recent(self, limit: int = 100) -> list[dict[str, Any]]:
        """The latest instances, newest first, each with ``live`` as PostgreSQL judges it now."""
        async with self._store.reading() as connection:
            rows = await connection.execute(_LIST, {"limit": limit})
            return [_plain(row._mapping) for row in rows]


def _plain(row: Any) -> dict[str, Any]:
    return {key: value.isoformat() if isinstance(value, datetime) else value for key, value in dict(row).items()}
