"""Which tenant an API key speaks for: configured keys, then keys in PostgreSQL.

How this works: a key is never compared as itself but as its SHA-256. Configured
``api_keys`` entries are hashed once at start (a ``sha256:<hex>`` entry is a digest
already, for deployments that keep keys in a secret store); an offered key's digest
is compared with each of them in constant time. A digest found in none is looked up
in the ``api_keys`` table (``phasegate keys``), and the answer, found or not, is
cached for ``api_key_cache_s``, so the hot path does not query PostgreSQL per
request; a revoked key keeps working on a gateway for at most that long. When an answer
is due again, one query asks for every request that needs it meanwhile: a query each
had every request of the round trip check out a connection of its own (the pool's
overflow opened and closed for it), a share of the gateway's CPU that docs/performance.md
gives, and at many held streams a wait for the pool. The table
is looked up by digest: an attacker chooses the key, not its digest, so the lookup's
timing tells nothing about stored keys.

The gateway is open (tenant ``default``) only while no key is configured and none
was ever created in the table; once one was, a key is required, even after every
key is revoked.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from app.api.errors import ServiceUnavailable, Unauthorized
from app.config import SHA256_PREFIX, GatewayConfig
from app.store import keys
from app.store.errors import StoreError

log = logging.getLogger("phasegate.api")

OPEN_TENANT = "default"
T = TypeVar("T")
MAX_CACHED = 10_000  # digests cached at most; unknown keys are cached too, so bound them


@dataclass(frozen=True, slots=True)
class _Cached:
    tenant: str | None  # None: no unrevoked key has this digest
    until: float


class Authenticator:
    """Maps ``Authorization: Bearer <key>`` to a tenant, or raises :class:`Unauthorized`."""

    def __init__(self, config: GatewayConfig, store: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self.reconfigure(config)
        self._reading = getattr(store, "reading", None)  # None: a store with no key table
        self._clock = clock
        self._cache: dict[str, _Cached] = {}
        self._table_has_keys = False  # once true, stays true
        self._table_checked_until = float("-inf")
        self._asking: dict[str | None, asyncio.Future[Any]] = {}  # queries in flight: a digest, or None for any key

    def reconfigure(self, config: GatewayConfig) -> None:
        """The configured keys and the cache's lifetime from ``config`` (at start, and at each reload)."""
        configured: list[tuple[bytes, str]] = []
        for key, tenant in config.api_keys.items():
            if not key.startswith(SHA256_PREFIX):
                configured.append((keys.key_digest(key).encode(), tenant))
            elif keys.SHA256_HEX.fullmatch(digest := key.removeprefix(SHA256_PREFIX).lower()):
                configured.append((digest.encode(), tenant))
            else:  # the entry itself is not logged: it may be a key pasted in the wrong place
                log.warning(
                    "api_keys: an entry of tenant %r is 'sha256:' without 64 hex digits; it matches no key", tenant
                )
        self._configured = configured
        self._ttl_s = config.api_key_cache_s

    async def required(self) -> bool:
        """Whether requests need a key: one is configured, or one was ever created."""
        if self._configured or self._table_has_keys or self._reading is None:
            return bool(self._configured or self._table_has_keys)
        now = self._clock()
        if now >= self._table_checked_until:
            self._table_has_keys = await self._ask(None, keys.any_keys)
            self._table_checked_until = now + self._ttl_s
        return self._table_has_keys

    async def tenant(self, authorization: str) -> str:
        """The tenant of the key in an ``Authorization`` header's value."""
        if not await self.required():
            return OPEN_TENANT
        scheme, _, offered = authorization.partition(" ")
        offered = offered.strip()
        if scheme.lower() != "bearer" or not offered:
            raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        tenant = await self.tenant_of_key(offered)
        if tenant is None:
            raise Unauthorized("incorrect API key")
        return tenant

    async def tenant_of_key(self, offered: str) -> str | None:
        """The tenant of ``offered`` if it is a valid key (configured or unrevoked in the table)."""
        digest = keys.key_digest(offered)
        found = None
        for configured, tenant in self._configured:  # every one: the time does not say which matched
            if hmac.compare_digest(configured, digest.encode()):
                found = tenant
        if found is not None or self._reading is None:
            return found
        now = self._clock()
        cached = self._cache.get(digest)
        if cached is None or now >= cached.until:
            cached = _Cached(
                await self._ask(digest, lambda connection: keys.tenant_of(connection, digest)), now + self._ttl_s
            )
            self._remember(digest, cached, now)
        return cached.tenant

    async def _ask(self, key: str | None, query: Callable[[Any], Awaitable[T]]) -> T:
        """``query``'s answer, on a connection of the pool: the answer of the query in
        flight for ``key`` if there is one (its error too), else of a new one."""
        asking = self._asking.get(key)
        if asking is None:
            asking = self._asking[key] = asyncio.ensure_future(self._query(query))
            asking.add_done_callback(lambda _: self._asking.pop(key, None))
        return cast(T, await asyncio.shield(asking))  # a client that leaves does not cancel the others' query

    async def _query(self, query: Callable[[Any], Awaitable[T]]) -> T:
        async with self._reading_keys() as connection:
            return await query(connection)

    def _remember(self, digest: str, cached: _Cached, now: float) -> None:
        if len(self._cache) >= MAX_CACHED:
            self._cache = {d: c for d, c in self._cache.items() if c.until > now}
            if len(self._cache) >= MAX_CACHED:
                self._cache.clear()
        self._cache[digest] = cached

    @contextlib.asynccontextmanager
    async def _reading_keys(self) -> AsyncIterator[Any]:
        assert self._reading is not None
        try:
            async with self._reading() as connection:
                yield connection
        except StoreError:  # a 503 the client may retry, not a 500
            raise ServiceUnavailable(
                "API keys cannot be checked: the request log is unavailable", code="auth_unavailable"
            ) from None
