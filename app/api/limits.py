"""Per-tenant limits: concurrent streams, requests and tokens per minute (429 beyond).

How this works: each gateway instance holds its share of every limit, ``1 / live
instances``, the same share as the retry budget's, which the instance's heartbeat
refreshes (``RetryBudget.share_among``). So the limits hold across instances with no
round trip on the hot path, and a request costs a few dictionary lookups and some
arithmetic. Requests and tokens per minute are token buckets that hold a minute's
share and refill continuously; concurrent streams are counted from the instance's
own live requests (``ctx.drivers``), so a stream that ends however it ends gives its
slot back. Tokens are charged twice: the prompt's estimate when the request is
admitted, the output tokens delivered when it ends; a request is admitted while the
bucket is not empty, so it may go into debt, which later requests wait out.

The trade-off of shares: a load balancer that sends a tenant's traffic unevenly makes
it meet an instance's share before the whole limit, and a concurrency share is at
least one stream per instance (with more instances than the limit, the limit is the
instance count). docs/configuration.md says so.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Container
from dataclasses import dataclass, field

from app.api.errors import RateLimited
from app.config import TenantLimit, TenantLimits


@dataclass(slots=True)
class _Bucket:
    per_minute: int
    level: float  # may go below zero (tokens charged after the fact)
    at: float

    def refill(self, now: float, share: float) -> float:
        capacity = self.per_minute * share
        self.level = min(capacity, self.level + (now - self.at) * self.per_minute / 60 * share)
        self.at = now
        return self.level

    def seconds_until(self, level: float, share: float) -> int:
        """Whole seconds until the bucket holds ``level``, at least one."""
        return max(1, math.ceil((level - self.level) / (self.per_minute / 60 * share)))


@dataclass(slots=True)
class _TenantUsage:
    limit: TenantLimit
    requests: _Bucket | None
    tokens: _Bucket | None
    streams: set[str] = field(default_factory=set)  # request ids admitted here, pruned when they end


class TenantLimiter:
    """Admits a tenant's requests within its share of its limits, or raises :class:`RateLimited`.

    ``live``: the request ids in flight on this instance. ``share``: this instance's
    share of every limit (``1 / live instances``)."""

    def __init__(
        self,
        limits: TenantLimits,
        live: Container[str],
        share: Callable[[], float],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._limits = limits
        self._live = live
        self._share = share
        self._clock = clock
        self._usage: dict[str, _TenantUsage | None] = {}  # None: no limit for this tenant

    def reconfigure(self, limits: TenantLimits) -> None:
        """The limits from now on (a configuration reload). A tenant whose limit changed keeps
        its streams in flight, counted against the new limit, and what its buckets hold, up
        to the new capacity."""
        self._limits = limits
        for tenant, usage in list(self._usage.items()):
            if (usage.limit if usage is not None else TenantLimit(0, 0, 0)) == limits.of(tenant):
                continue
            del self._usage[tenant]
            fresh = self._usage_of(tenant)
            if usage is None or fresh is None:
                continue
            fresh.streams = usage.streams
            for old, new in ((usage.requests, fresh.requests), (usage.tokens, fresh.tokens)):
                if old is not None and new is not None:
                    new.level = min(new.level, old.level)

    def admit(self, tenant: str, request_id: str, prompt_tokens: int) -> None:
        usage = self._usage_of(tenant)
        if usage is None:
            return
        share, now = self._share(), self._clock()
        if usage.limit.concurrent_streams:
            usage.streams = {rid for rid in usage.streams if rid in self._live}
            allowed = max(1, math.floor(usage.limit.concurrent_streams * share))
            if len(usage.streams) >= allowed:
                raise RateLimited(
                    f"tenant {tenant!r} has {len(usage.streams)} requests in flight here, its limit"
                    f" (concurrent_streams {usage.limit.concurrent_streams} over all gateways)",
                    code="concurrent_streams_exceeded",
                    retry_after_s=1,
                )
        if usage.requests is not None and usage.requests.refill(now, share) < 1:
            raise RateLimited(
                f"tenant {tenant!r} is over its limit of {usage.limit.requests_per_minute} requests per minute",
                code="requests_per_minute_exceeded",
                retry_after_s=usage.requests.seconds_until(1, share),
            )
        if usage.tokens is not None and usage.tokens.refill(now, share) <= 0:
            raise RateLimited(
                f"tenant {tenant!r} is over its limit of {usage.limit.tokens_per_minute} tokens per minute",
                code="tokens_per_minute_exceeded",
                retry_after_s=usage.tokens.seconds_until(0, share),
            )
        if usage.requests is not None:
            usage.requests.level -= 1
        if usage.tokens is not None:
            usage.tokens.level -= prompt_tokens
        if usage.limit.concurrent_streams:
            usage.streams.add(request_id)

    def charge(self, tenant: str, tokens: int) -> None:
        """``tokens`` more used by an admitted request (its output, once delivered)."""
        usage = self._usage.get(tenant)
        if usage is not None and usage.tokens is not None and tokens > 0:
            usage.tokens.refill(self._clock(), self._share())
            usage.tokens.level -= tokens

    def _usage_of(self, tenant: str) -> _TenantUsage | None:
        try:
            return self._usage[tenant]
        except KeyError:
            pass
        limit = self._limits.of(tenant)
        now, share = self._clock(), self._share()
        usage = None
        if limit.concurrent_streams or limit.requests_per_minute or limit.tokens_per_minute:
            usage = _TenantUsage(
                limit,
                _Bucket(limit.requests_per_minute, limit.requests_per_minute * share, now)
                if limit.requests_per_minute
                else None,
                _Bucket(limit.tokens_per_minute, limit.tokens_per_minute * share, now)
                if limit.tokens_per_minute
                else None,
            )
        self._usage[tenant] = usage
        return usage
