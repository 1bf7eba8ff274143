"""Workers that join the fleet by themselves (docs/design.md §16, docs/worker-protocol.md),
with real worker processes started with ``--join`` and gateway instances on one PostgreSQL."""

from __future__ import annotations

import signal
import time
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from app.contract.fleet_join import JOIN_PATH, LEASE_TTL_S, RENEW_EVERY_S
from app.store.fleet import FleetStore
from statemachine import events as ev
from tests.app.driver.test_fleet_changes import wait_for
from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.transcript import check_request, stream_chat
from tests.support.workers import running_worker

WORKER_TOKEN = "fleet-worker-token-0123456789"
pytestmark = pytest.mark.usefixtures("heard_by_notify_only")
SIM = ["--sim-decode-ms-per-token", "40", "--heartbeat-ms", "100", "--max-model-len", "512"]


def joining(gateway: RunningGateway, worker_id: str, revision: str = "") -> list[str]:
    model = f"{MODEL}={revision}" if revision else MODEL
    return [*SIM, "--model", model, "--worker-id", worker_id, "--join", gateway.url]


def events(gateway: RunningGateway, replica_id: str | None = None) -> list[dict[str, Any]]:
    return list(reversed(gateway.call(FleetStore(gateway.gateway.ctx.store).events(limit=500, replica_id=replica_id))))


def test_a_joined_worker_serves_through_another_instance_and_lapses_once_when_killed(database_url: str) -> None:
    with ExitStack() as stack:
        gateways = [stack.enter_context(running_gateway(database_url, [], worker_token=WORKER_TOKEN)) for _ in range(3)]
        a, b, c = gateways
        worker = stack.enter_context(running_worker(token=WORKER_TOKEN, args=joining(a, "j1", "sim-rev-1")))
        # from the worker answering its readiness probe: its join (the gateway probes it
        # first) and the change reaching the other instance, by NOTIFY
        wait_for(lambda: "j1" in b.gateway.ctx.pool.replicas)
        answer = b.openai().chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "joined"}], max_tokens=3
        )
        request_id = answer.headers["x-request-id"]
        assert [e.replica_id for e in b.events(request_id) if isinstance(e, ev.AttemptStarted)] == ["j1"]
        (joined,) = events(a, "j1")
        assert (joined["event"], joined["source"], joined["actor"]) == ("joined", "join", "worker j1")
        assert joined["models"] == {MODEL: "sim-rev-1"} and joined["url"] == worker.base_url
        # SIGKILLed mid-stream: its attempt fails as a replica death; it lapses once
        body = {"model": MODEL, "messages": [{"role": "user", "content": "killed"}], "max_tokens": 200}
        with (
            httpx.Client(base_url=c.url, timeout=60) as http,
            http.stream("POST", "/v1/chat/completions", json={**body, "stream": True, "ignore_eos": True}) as response,
        ):
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            killed_at = time.monotonic()
            worker.kill()
            rest = list(lines)
        assert any("upstream_decode_interrupted" in line for line in rest)
        wait_for(lambda: any(e["event"] == "lapsed" for e in events(a, "j1")), LEASE_TTL_S + 15)
        assert time.monotonic() - killed_at >= LEASE_TTL_S - RENEW_EVERY_S - 1.0  # its lease ran out: not before
        time.sleep(2.5)  # every instance's lapse sweep ran again meanwhile
        assert [e["event"] for e in events(a, "j1")] == ["joined", "lapsed"]
        wait_for(lambda: all("j1" not in g.gateway.ctx.pool.replicas for g in gateways))


def test_a_lease_that_ran_out_while_no_gateway_ran_never_enters_the_next_ones_pool(database_url: str) -> None:
    """The demo's case: its workers stop after its gateway, so they cannot leave; the next
    start lapses them before it reads the membership, never probing or ejecting them."""
    from app.store.fleet_model import DeclaredReplica
    from tests.support.audit import execute_sql

    gone = DeclaredReplica("gone-1", "http://127.0.0.1:9", models=((MODEL, None),), incarnation="inc-1")
    with running_gateway(database_url, [], worker_token=WORKER_TOKEN) as a:
        fleet = FleetStore(a.gateway.ctx.store)
        a.call(fleet.join(gone, source="join", actor="worker gone-1", instance_id=None))
        assert a.call(fleet.renew("gone-1", "inc-1", 3600)) == "serving"  # no instance lapses it meanwhile

    # as if its renewals stopped an hour ago, while no gateway ran
    ran_out = "UPDATE replicas SET lease_expires_at = now() - interval '1 hour' WHERE replica_id = 'gone-1'"
    assert execute_sql(database_url, ran_out) == 1
    with running_gateway(database_url, [], worker_token=WORKER_TOKEN) as b:
        assert "gone-1" not in b.gateway.ctx.pool.replicas and not b.gateway.ctx.pool.retired
        assert [(e["event"], e["instance_id"]) for e in events(b, "gone-1")] == [
            ("joined", None),
            ("lapsed", b.gateway.ctx.gateway_id),
        ]


def test_a_new_incarnation_replaces_the_old_and_a_drain_cordons_first(database_url: str) -> None:
    with ExitStack() as stack:
        a = stack.enter_context(running_gateway(database_url, [], worker_token=WORKER_TOKEN))
        old = stack.enter_context(running_worker(token=WORKER_TOKEN, args=joining(a, "j1")))
        wait_for(lambda: "j1" in a.gateway.ctx.pool.replicas)
        new = stack.enter_context(running_worker(token=WORKER_TOKEN, args=joining(a, "j1")))
        wait_for(
            lambda: (
                a.gateway.ctx.pool.replicas.get("j1") and a.gateway.ctx.pool.replicas["j1"].config.url == new.base_url
            ),
        )
        first, second = events(a, "j1")[0]["incarnation"], events(a, "j1")[-1]["incarnation"]
        assert [e["event"] for e in events(a, "j1")] == ["joined", "left", "joined"] and first != second
        old.kill()
        # a stream runs on the new one while it drains: it ends normally; nothing new goes there
        with ExitStack() as streaming:
            from concurrent.futures import ThreadPoolExecutor

            pool = streaming.enter_context(ThreadPoolExecutor(1))
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "drain"}],
                "max_tokens": 30,
                "ignore_eos": True,
            }
            stream = pool.submit(stream_chat, a.url, body)
            wait_for(lambda: a.gateway.ctx.pool.replicas["j1"].outstanding == 1)
            new.proc.send_signal(signal.SIGTERM)
            wait_for(lambda: a.gateway.ctx.pool.replicas["j1"].cordoned)
            transcript = stream.result(30)
        assert transcript.error is None and transcript.done
        check_request(a.events(transcript.request_id), transcript)
        wait_for(lambda: events(a, "j1")[-1]["event"] == "left")
        tail = [(e["event"], e["actor"], e["incarnation"]) for e in events(a, "j1")[-2:]]
        assert tail == [("cordoned", "worker j1", second), ("left", "worker j1", second)]


def test_joining_needs_the_worker_token(database_url: str) -> None:
    with running_gateway(database_url, []) as open_gateway:
        refused = httpx.post(open_gateway.url + JOIN_PATH, json={"id": "x", "incarnation": "y", "url": "http://h:1"})
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "worker_join_disabled"
    with running_gateway(database_url, [], worker_token=WORKER_TOKEN) as gateway:
        body = {"id": "x", "incarnation": "y", "url": "http://127.0.0.1:9", "models": {MODEL: None}}
        assert httpx.post(gateway.url + JOIN_PATH, json=body).status_code == 401
        wrong = {"authorization": "Bearer not-the-worker-token-at-all"}
        assert httpx.post(gateway.url + JOIN_PATH, json=body, headers=wrong).status_code == 401
        right = {"authorization": f"Bearer {WORKER_TOKEN}"}
        for bad, code in (({"models": {"s\x00m": None}}, "invalid_models"), ({"id": "../x"}, "invalid_replica_id")):
            refused = httpx.post(gateway.url + JOIN_PATH, json={**body, **bad}, headers=right)
            assert refused.status_code == 400 and refused.json()["error"]["code"] == code
        unreachable = httpx.post(gateway.url + JOIN_PATH, json=body, headers=right, timeout=30)
        assert unreachable.status_code == 422 and unreachable.json()["error"]["code"] == "replica_unreachable"
        (refusal,) = events(gateway)
        assert (refusal["event"], refusal["replica_id"]) == ("refused", "x")
        assert gateway.gateway.ctx.pool.replicas == {}
