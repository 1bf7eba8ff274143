"""A reload changes a tenant's limits (app/api/limits.py, ``TenantLimiter.reconfigure``): its
streams in flight count against the new limit, its buckets hold no more than the new
capacity, and a tenant whose limit did not change keeps its buckets as they were."""

from __future__ import annotations

import pytest

from app.api.errors import RateLimited
from app.api.limits import TenantLimiter
from app.config import TenantLimits


def limits(**tenants: dict[str, int]) -> TenantLimits:
    return TenantLimits.from_mapping({"tenants": tenants})


def test_a_lower_limit_applies_at_once_and_streams_in_flight_count_against_it() -> None:
    live = {"r1", "r2"}
    now = [0.0]
    limiter = TenantLimiter(
        limits(a={"concurrent_streams": 5, "requests_per_minute": 600}), live, lambda: 1.0, lambda: now[0]
    )
    limiter.admit("a", "r1", 1)
    limiter.admit("a", "r2", 1)
    limiter.admit("b", "r9", 1)  # no limit
    limiter.reconfigure(limits(a={"concurrent_streams": 2, "requests_per_minute": 1}, b={"requests_per_minute": 1}))
    with pytest.raises(RateLimited) as refused:
        limiter.admit("a", "r3", 1)
    assert refused.value.code == "concurrent_streams_exceeded"  # r1 and r2 are still live here
    live.discard("r2")
    limiter.admit("a", "r3", 1)  # the bucket holds at most one request now: this one
    live.discard("r3")
    with pytest.raises(RateLimited) as refused:
        limiter.admit("a", "r4", 1)
    assert refused.value.code == "requests_per_minute_exceeded"
    limiter.admit("b", "r10", 1)
    with pytest.raises(RateLimited):
        limiter.admit("b", "r11", 1)


def test_a_tenant_whose_limit_did_not_change_keeps_its_buckets() -> None:
    limiter = TenantLimiter(limits(a={"requests_per_minute": 1}), set(), lambda: 1.0, lambda: 0.0)
    limiter.admit("a", "r1", 1)
    limiter.reconfigure(limits(a={"requests_per_minute": 1}, b={"requests_per_minute": 5}))
    with pytest.raises(RateLimited):
        limiter.admit("a", "r2", 1)  # not refilled by the reload
