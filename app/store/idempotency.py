"""Idempotency keys in PostgreSQL (migration 0005): which request a key started.

``claim`` is one statement in the common case: the INSERT wins the key, or finds it
taken (and takes it over only if it expired); a second statement reads the taken row.
Two POSTs racing for one key are decided by the primary key, never by a read first.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import text

from app.store.postgres import PostgresEventStore

_CLAIM = text(
    """
    INSERT INTO idempotency_keys (tenant, key, request_id, body_digest, expires_at)
    VALUES (:tenant, :key, :request_id, :digest, now() + CAST(:ttl_ms AS integer) * interval '1 millisecond')
    ON CONFLICT (tenant, key) DO UPDATE
       SET request_id = EXCLUDED.request_id, body_digest = EXCLUDED.body_digest,
           created_at = now(), expires_at = EXCLUDED.expires_at
     WHERE idempotency_keys.expires_at <= now()
    RETURNING request_id
    """
)
_TAKEN = text("SELECT request_id, body_digest FROM idempotency_keys WHERE tenant = :tenant AND key = :key")


@dataclass(frozen=True, slots=True)
class Claimed:
    """The key's request: ``new`` when this claim started it, else the earlier one's."""

    request_id: str
    body_digest: str
    new: bool


class IdempotencyKeys:
    """The ``idempotency_keys`` table, over a store's connection pool."""

    def __init__(self, store: PostgresEventStore) -> None:
        self._store = store

    async def claim(self, tenant: str, key: str, request_id: str, digest: str, ttl_s: float) -> Claimed:
        """Bind ``key`` to ``request_id`` unless a live binding holds it; which one holds it now."""
        values = {
            "tenant": tenant,
            "key": key,
            "request_id": request_id,
            "digest": digest,
            "ttl_ms": round(ttl_s * 1000),
        }
        async with self._store.writing() as connection:
            if (await connection.execute(_CLAIM, values)).first() is not None:
                return Claimed(request_id, digest, new=True)
            row = (await connection.execute(_TAKEN, {"tenant": tenant, "key": key})).one()
            return Claimed(row.request_id, row.body_digest, new=False)
