"""API keys in PostgreSQL (``api_keys``, migration 0006): stored as SHA-256, never in clear.

``phasegate keys create`` makes a key, stores its digest with the tenant, and shows
the key once; nothing can show it again. ``revoke`` stamps ``revoked_at``: the row
stays, so a revoked key is never mistaken for an unknown one and ``list`` keeps the
history. The gateway looks keys up by digest (:func:`tenant_of`) and caches the
answer briefly (``app/api/auth.py``).
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import text

KEY_PREFIX = "pgk-"  # recognisable in a secret scanner; the rest is 256 random bits
SHA256_HEX = re.compile(r"[0-9a-f]{64}")

_CREATE = text("INSERT INTO api_keys (id, tenant, key_sha256) VALUES (:id, :tenant, :digest) RETURNING created_at")
_LIST = text(
    "SELECT id, tenant, key_sha256, created_at, revoked_at FROM api_keys"
    " WHERE CAST(:tenant AS text) IS NULL OR tenant = :tenant ORDER BY created_at, id"
)
_REVOKE = text("UPDATE api_keys SET revoked_at = now() WHERE id = :id AND revoked_at IS NULL RETURNING id")
_TENANT_OF = text("SELECT tenant FROM api_keys WHERE key_sha256 = :digest AND revoked_at IS NULL")
_ANY = text("SELECT EXISTS (SELECT 1 FROM api_keys)")


def key_digest(key: str) -> str:
    """The SHA-256 of ``key`` in hex: what is stored, configured (``sha256:…``) and compared."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True, slots=True)
class StoredKey:
    """A key as ``api_keys`` keeps it: no key, only its digest."""

    id: str
    tenant: str
    key_sha256: str
    created_at: datetime
    revoked_at: datetime | None

    @property
    def fingerprint(self) -> str:
        """Enough of the digest to match a key with its row, too little to look it up."""
        return f"sha256:{self.key_sha256[:12]}"


def new_key() -> tuple[str, str]:
    """A new key id and key."""
    return f"key_{secrets.token_hex(8)}", KEY_PREFIX + secrets.token_urlsafe(32)


async def create_key(connection: Any, tenant: str) -> tuple[StoredKey, str]:
    """Store a new key for ``tenant``; the row and the key (shown once, stored nowhere)."""
    key_id, key = new_key()
    digest = key_digest(key)
    created_at = (await connection.execute(_CREATE, {"id": key_id, "tenant": tenant, "digest": digest})).scalar_one()
    return StoredKey(key_id, tenant, digest, created_at, None), key


async def list_keys(connection: Any, tenant: str | None = None) -> list[StoredKey]:
    rows = await connection.execute(_LIST, {"tenant": tenant})
    return [StoredKey(*row) for row in rows]


async def revoke_key(connection: Any, key_id: str) -> bool:
    """Revoke ``key_id``; false when there is no such key or it was revoked already."""
    return (await connection.execute(_REVOKE, {"id": key_id})).first() is not None


async def tenant_of(connection: Any, digest: str) -> str | None:
    """The tenant of the unrevoked key whose digest is ``digest``, if any."""
    found: str | None = (await connection.execute(_TENANT_OF, {"digest": digest})).scalar_one_or_none()
    return found


async def any_keys(connection: Any) -> bool:
    """Whether a key was ever created here: then the gateway requires one, even after
    every key is revoked (revoking the last key must not open the gateway)."""
    return bool((await connection.execute(_ANY)).scalar_one())
