"""Batched lease renewal (``POST /v1/leases/renew``) on a real sim worker."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

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


async def test_numbered_renewals_are_answered_with_how_long_the_lease_now_runs(sim_client: WorkerClient):
    """The gateway's renewals name their number and the last one answered (the cap itself:
    tests/app/worker/test_engines_pure.py). One naming an answer to a renewal this worker
    never read extends nothing; the answer says how long the lease runs."""
    ttl, rid = 30.0, request_id()
    stream = await sim_client.start(
        request_id=rid, attempt=1, lease_epoch=1, lease_ttl_s=ttl, model="sim", prompt="go", params=LONG
    )
    await collect(stream, max_frames=2)
    (renewed,) = await sim_client.renew_many([(rid, 1, 1, ttl, 1, 0)])  # the start answered: a TTL from now
    answered = time.monotonic()  # the worker read renewal 1 before this
    assert isinstance(renewed, LeaseRenewed) and renewed.lease_ttl_ms == ttl * 1000
    await asyncio.sleep(0.05)
    sent = time.monotonic()
    (unknown,) = await sim_client.renew_many([(rid, 1, 1, ttl, 6, 5)])  # 5 was never read here
    assert isinstance(unknown, LeaseRenewed)
    assert unknown.lease_ttl_ms <= (answered + ttl - sent) * 1000 + 1 < ttl * 1000  # as it stood
    await sim_client.cancel(rid, 1, 1)
