"""Replicas leaving the fleet (docs/design.md §16), with real parts: gateway instances on one
PostgreSQL, real sim worker processes, the admin API over HTTP and raw SSE transcripts
checked against the log.

A ``DELETE`` without a drain deadline lets every live attempt run to its end, then the
replica leaves; and replicas that come and go leave nothing behind in a gateway: its pool,
its fleet's view and its metrics hold the live members only, however many went before.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from datetime import datetime

import httpx
import pytest

from app.store.fleet import FleetStore
from statemachine import events as ev
from tests.app.driver.test_fleet_changes import AUTH, SLOW, add, chat, run_streams, two_gateways, wait_for
from tests.support.gateway import RunningGateway
from tests.support.transcript import check_request
from tests.support.workers import running_worker

pytestmark = pytest.mark.usefixtures("heard_by_notify_only")


def replica_events(gateway: RunningGateway, replica_id: str) -> list[tuple[str, float]]:
    """The replica's fleet events, oldest first: each with its time (PostgreSQL's clock)."""
    events = gateway.call(FleetStore(gateway.gateway.ctx.store).events(limit=1000, replica_id=replica_id))
    return [(e["event"], datetime.fromisoformat(e["at"]).timestamp()) for e in sorted(events, key=lambda e: e["seq"])]


def test_a_delete_without_a_drain_deadline_lets_each_stream_end_then_the_replica_leaves(database_url: str) -> None:
    with ExitStack() as stack:
        a, b = stack.enter_context(two_gateways(database_url))
        w1, w2 = (stack.enter_context(running_worker(args=[*SLOW, "--max-running", "64"])) for _ in range(2))
        assert add(a, w1, "w1").status_code == 201
        wait_for(lambda: "w1" in b.gateway.ctx.pool.replicas)
        with ThreadPoolExecutor(1) as background:
            streams = background.submit(run_streams, b, 4, 60, "no deadline")  # ~2.4 s each
            wait_for(lambda: b.gateway.ctx.pool.replicas["w1"].outstanding == 4)
            assert add(a, w2, "w2").status_code == 201
            wait_for(lambda: "w2" in b.gateway.ctx.pool.replicas)
            removed = httpx.delete(f"{a.url}/admin/replicas/w1", headers=AUTH, timeout=30)
            assert removed.status_code == 202, removed.text
            assert removed.json()["leaving"] is True and removed.json()["state"] == "cordoned"
            wait_for(lambda: b.gateway.ctx.pool.replicas["w1"].cordoned)  # propagated
            placed_after = chat(b, "after the delete")
            transcripts = streams.result(60)
            ended_at = time.time()
        for transcript in transcripts:  # each stream whole: no error, every token, as logged
            assert transcript.error is None and transcript.finish_reason == "length"
            state = check_request(b.events(transcript.request_id), transcript)
            assert state.replicas_tried == ("w1",)
        assert [e.replica_id for e in b.events(placed_after) if isinstance(e, ev.AttemptStarted)] == ["w2"]
        wait_for(lambda: any(name == "left" for name, _ in replica_events(a, "w1")))
        events = replica_events(a, "w1")
        assert [name for name, _ in events] == ["joined", "cordoned", "left"]
        assert events[-1][1] >= ended_at - 1.0  # it left once its streams had ended, not before
        wait_for(lambda: "w1" not in a.gateway.ctx.pool.replicas and "w1" not in b.gateway.ctx.pool.replicas)


def test_replicas_that_join_and_leave_leave_nothing_behind_in_a_gateway(database_url: str) -> None:
    """Each member's pool entry, client, fleet view and metric series go with it: after
    twelve came and went, the gateway holds the one still serving."""
    with ExitStack() as stack:
        a, b = stack.enter_context(two_gateways(database_url))
        worker = stack.enter_context(running_worker(args=SLOW))
        for n in range(12):
            assert add(a, worker, f"r{n}").status_code == 201, n
            wait_for(lambda n=n: f"r{n}" in b.gateway.ctx.pool.replicas)
            if n > 0:  # the one before leaves as this one serves
                assert chat(b, f"through r{n}")
                assert httpx.delete(f"{a.url}/admin/replicas/r{n - 1}", headers=AUTH, timeout=30).status_code == 202
        for gateway in (a, b):
            ctx, fleet = gateway.gateway.ctx, gateway.gateway.fleet
            wait_for(lambda ctx=ctx: sorted(ctx.pool.replicas) == ["r11"] and not ctx.pool.retired, 15.0)
            assert sorted(fleet.members) == ["r11"]
            healthy = gateway.gateway.ctx.metrics.replica_healthy
            wait_for(lambda healthy=healthy: {labels[0] for labels in healthy._metrics} <= {"r11"})
            scraped = httpx.get(f"{gateway.url}/metrics").text
            series = {line.split('replica="')[1].split('"')[0] for line in scraped.splitlines() if 'replica="' in line}
            assert series <= {"r11"}, series
