"""Batched lease renewal (``POST /v1/leases/renew``) on a real sim worker."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from app.contract.worker_protocol import RENEWAL_SLACK
from app.replicas.worker_client import LeaseRenewed, WorkerClient, http_client
from app.replicas.worker_errors import LeaseLost, RequestRefused
from tests.support.streams import attempt_state, collect, metric
from tests.support.workers import WorkerProcess, request_id

LONG = {"max_tokens": 2000, "ignore_eos": True}


async def test_one_call_renews_many_leases_and_answers_each_in_order(
    sim_worker: WorkerProcess, sim_client: WorkerClient
):
    live = [request_id() for _ in range(3)]
    streams = [
        await sim_client.start(
            request_id=rid, attempt=1, lease_epoch=2, lease_ttl_s=30, model="sim", prompt="go", params=LONG
        )
        for rid in live
    ]
    for stream in streams:
        await collect(stream, max_frames=2)
    calls_before = await metric(sim_worker.base_url, "phasegate_worker_renew_calls_total")
    renewed_before = await metric(sim_worker.base_url, "phasegate_worker_leases_renewed_total")

    leases = [(rid, 1, 2, 60.0) for rid in live]
    leases.insert(1, (request_id(), 1, 1, 60.0))  # never started here
    leases.append((live[0], 1, 1, 60.0))  # an older epoch than the attempt's
    answers = await sim_client.renew_many(leases)

    assert [type(answer) for answer in answers] == [LeaseRenewed, LeaseLost, LeaseRenewed, LeaseRenewed, LeaseLost]
    assert all(a.lease_ttl_ms == 60_000 and a.lease_epoch == 2 for a in answers if isinstance(a, LeaseRenewed))
    unknown, stale = answers[1], answers[4]
    assert isinstance(unknown, LeaseLost) and (unknown.code, unknown.status, unknown.released) == (
        "unknown_attempt",
        404,
        True,
    )
    assert isinstance(stale, LeaseLost) and (stale.code, stale.status, stale.released) == (
        "stale_lease_epoch",
        409,
        False,
    )
    # the worker's own view: each live lease (granted for 30 s) now ends a minute after the renewal
    for rid in live:
        assert (await attempt_state(sim_worker.base_url, rid))["lease_ends_ms"] >= 60_000
    assert await metric(sim_worker.base_url, "phasegate_worker_renew_calls_total") == calls_before + 1
    assert await metric(sim_worker.base_url, "phasegate_worker_leases_renewed_total") == renewed_before + 3
    for rid in live:
        await sim_client.cancel(rid, 1, 2)


@pytest.mark.parametrize(
    ("body", "code", "field"),
    [
        ({}, "missing_field", "leases"),
        ({"leases": []}, "invalid_field", "leases"),
        ({"leases": {"request_id": "r"}}, "invalid_field", "leases"),
        ({"leases": ["r"]}, "invalid_field", "leases[0]"),
        (
            {"leases": [{"request_id": "r", "attempt": 1, "lease_epoch": 1, "lease_ttl_ms": 900}, {"request_id": "r"}]},
            "missing_field",
            "leases[1].lease_ttl_ms",
        ),
        (
            {"leases": [{"request_id": "r", "attempt": 1, "lease_epoch": 1, "lease_ttl_ms": 9}]},
            "invalid_field",
            "leases[0].lease_ttl_ms",
        ),
        ({"leases": [], "extra": 1}, "unknown_field", "extra"),
    ],
)
async def test_a_bad_batch_is_refused_whole_naming_the_entry(
    sim_worker: WorkerProcess, body: dict[str, Any], code: str, field: str
):
    async with http_client() as http:
        response = await http.post(sim_worker.base_url + "/v1/leases/renew", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["field"]) == (code, field)
    assert field.split(".")[0] in error["message"] or code == "unknown_field"


async def test_the_client_raises_when_the_whole_batch_is_refused(sim_client: WorkerClient):
    with pytest.raises(RequestRefused) as refused:
        await sim_client.renew_many([])
    assert (refused.value.status, refused.value.code) == (400, "invalid_field")


async def test_a_renewal_extends_no_further_than_a_third_of_a_ttl_past_the_last_answered_ones(
    sim_client: WorkerClient,
):
    """The gateway names the last renewal whose answer came: when the answers of the ones
    after it were lost, the worker's lease ends no later than ``RENEWAL_SLACK`` of a TTL past
    that one's TTL (the gateway's view of the lease), however late they were read. The
    bounds are taken from this test's own clock around each call, so no pause breaks them."""
    ttl, rid = 6.0, request_id()
    slack = ttl * RENEWAL_SLACK
    stream = await sim_client.start(
        request_id=rid, attempt=1, lease_epoch=1, lease_ttl_s=ttl, model="sim", prompt="go", params=LONG
    )
    start_answered = time.monotonic()  # the worker read the start before this
    await collect(stream, max_frames=2)
    await asyncio.sleep(ttl / 2)
    sent = time.monotonic()
    (late,) = await sim_client.renew_many([(rid, 1, 1, ttl, 2, 0)])  # renewal 1's answer was lost
    assert isinstance(late, LeaseRenewed)
    # from when the worker read it, no further than the start's TTL and the slack: not a whole TTL
    assert late.lease_ttl_ms <= (start_answered + ttl + slack - sent) * 1000 + 1 < ttl * 1000
    (again,) = await sim_client.renew_many([(rid, 1, 1, ttl, 3, 2)])  # renewal 2's answer came
    answered_at = time.monotonic()  # renewal 2 was read after `sent`, renewal 3 before this
    assert isinstance(again, LeaseRenewed)
    assert again.lease_ttl_ms >= min(ttl, sent + ttl + slack - answered_at) * 1000 - 1
    assert again.lease_ttl_ms > late.lease_ttl_ms
    (by_hand,) = await sim_client.renew_many([(rid, 1, 1, ttl)])  # no number: from now, as asked
    assert isinstance(by_hand, LeaseRenewed) and by_hand.lease_ttl_ms == ttl * 1000
    await sim_client.cancel(rid, 1, 1)
