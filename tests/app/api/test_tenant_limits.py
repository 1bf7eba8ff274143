"""Per-tenant limits (docs/design.md §13): 429 with Retry-After and a stable code, held across two
gateways on one PostgreSQL, over real sim workers, with the real ``openai`` client."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack

import openai
import pytest

from app.api.limits import TenantLimiter
from app.config import ConfigError, TenantLimit, TenantLimits, load_config
from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.workers import WorkerProcess

KEYS = {"key-a": "team-a", "key-b": "team-b"}
MESSAGES = [{"role": "user", "content": "Hello"}]  # an estimated 2 prompt tokens


def ask(gateway: RunningGateway, key: str, max_tokens: int = 2, *, stream: bool = False) -> None:
    client = gateway.openai(api_key=key)
    if stream:
        for _ in client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=max_tokens, stream=True):
            pass
    else:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=max_tokens)


def limited(gateway: RunningGateway, key: str, max_tokens: int = 2) -> openai.RateLimitError:
    with pytest.raises(openai.RateLimitError) as refusal:
        ask(gateway, key, max_tokens)
    error = refusal.value
    assert error.status_code == 429 and "x-should-retry" not in error.response.headers
    assert int(error.response.headers["retry-after"]) >= 1
    body = error.response.json()["error"]
    assert body["type"] == "rate_limit_error" and body["request_id"] == error.response.headers["x-request-id"]
    return error


@pytest.fixture
def two_gateways(
    database_url: str, sim_pair: list[WorkerProcess], request: pytest.FixtureRequest
) -> Iterator[tuple[RunningGateway, RunningGateway]]:
    limits = request.param
    with ExitStack() as stack:
        pair = tuple(
            stack.enter_context(
                # heartbeats every 2 s: each learns of the other soon; 0.9 s let a loaded
                # machine fence one mid-test ("lost its place in the log")
                running_gateway(database_url, sim_pair, api_keys=KEYS, tenant_limits=limits, instance_lease_ttl_s=6.0)
            )
            for _ in range(2)
        )
        deadline = time.monotonic() + 30
        while any(g.gateway.ctx.budget.share != 0.5 for g in pair):  # both heard of the other
            assert time.monotonic() < deadline, "the gateways never saw each other"
            time.sleep(0.05)
        yield pair[0], pair[1]


RPM = {"requests_per_minute": 4, "tenants": {"team-b": {"requests_per_minute": 0}}}


@pytest.mark.parametrize("two_gateways", [RPM], indirect=True)
def test_requests_per_minute_hold_across_two_gateways(two_gateways: tuple[RunningGateway, RunningGateway]) -> None:
    a, b = two_gateways
    for gateway in (a, b):  # each holds half of the 4 a minute
        ask(gateway, "key-a")
        ask(gateway, "key-a")
        error = limited(gateway, "key-a")
        assert error.code == "requests_per_minute_exceeded"
        assert 25 <= int(error.response.headers["retry-after"]) <= 30  # one request refills in 30 s here
    for _ in range(5):
        ask(a, "key-b")  # 0: no limit for team-b


CONCURRENT = {"concurrent_streams": 2}


@pytest.mark.parametrize("two_gateways", [CONCURRENT], indirect=True)
def test_concurrent_streams_hold_across_two_gateways(two_gateways: tuple[RunningGateway, RunningGateway]) -> None:
    a, b = two_gateways
    stream = a.openai(api_key="key-a").chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=400, stream=True
    )
    chunks = iter(stream)
    next(chunks)  # the stream is live on a
    error = limited(a, "key-a")
    assert error.code == "concurrent_streams_exceeded" and error.response.headers["retry-after"] == "1"
    ask(b, "key-a")  # b holds the other one
    ask(a, "key-b")  # another tenant is not held back
    for _ in chunks:
        pass
    a.settle()
    ask(a, "key-a")  # the ended stream gave its slot back


def test_tokens_per_minute_count_prompts_and_what_was_delivered(
    database_url: str, sim_pair: list[WorkerProcess]
) -> None:
    limits = {"tenants": {"team-a": {"tokens_per_minute": 30}}}
    with running_gateway(database_url, sim_pair, api_keys=KEYS, tenant_limits=limits) as gateway:
        started = time.monotonic()
        ask(gateway, "key-a", max_tokens=20)  # 30 - 2 - 20 = 8 left
        ask(gateway, "key-a", max_tokens=20, stream=True)  # not empty, so admitted: 8 - 22 = -14
        error = limited(gateway, "key-a")
        taken_s = time.monotonic() - started
        assert error.code == "tokens_per_minute_exceeded"
        # 14 tokens at 0.5 a second, less what came back (a second's wait per half token)
        # while the two answers took their time on a loaded machine
        assert 27 - taken_s <= int(error.response.headers["retry-after"]) <= 29
        ask(gateway, "key-b", max_tokens=40)  # team-b has no limit


def test_limits_are_read_from_a_file_and_checked(tmp_path: object) -> None:
    config = load_config(
        None,
        tenant_limits={
            "concurrent_streams": 8,
            "requests_per_minute": 600,
            "tenants": {"team-a": {"tokens_per_minute": 1000}, "team-b": {"concurrent_streams": 0}},
        },
    )
    limits = config.tenant_limits
    assert limits.of("team-a") == TenantLimit(8, 600, 1000)
    assert limits.of("team-b") == TenantLimit(0, 600, None)
    assert limits.of("anyone") == TenantLimit(8, 600, None)
    assert load_config(None).tenant_limits.of("anyone") == TenantLimit()  # off unless configured
    for bad in ({"requests_per_minute": -1}, {"tokens_per_minute": 1.5}, {"per_hour": 1}, {"tenants": {"a": 1}}):
        with pytest.raises(ConfigError, match="tenant_limits"):
            load_config(None, tenant_limits=bad)


def test_a_bucket_refills_with_time_and_follows_the_share() -> None:
    now = [0.0]
    share = [1.0]
    live: set[str] = set()
    limiter = TenantLimiter(
        TenantLimits(TenantLimit(requests_per_minute=60)), live, lambda: share[0], clock=lambda: now[0]
    )
    for n in range(60):
        limiter.admit("t", f"r{n}", 0)
    with pytest.raises(Exception, match="requests per minute") as refusal:
        limiter.admit("t", "r60", 0)
    assert getattr(refusal.value, "retry_after_s", None) == 1
    now[0] += 1.0
    limiter.admit("t", "r61", 0)  # one a second
    share[0] = 0.5  # a second instance joined: half the rate
    now[0] += 1.0
    with pytest.raises(Exception, match="requests per minute"):
        limiter.admit("t", "r62", 0)
    now[0] += 1.0
    limiter.admit("t", "r63", 0)
