"""The fleet changes under running gateways (docs/design.md §16), with real parts: two
gateway instances on one PostgreSQL, real sim worker processes, the admin API over HTTP,
the ``openai`` client and raw SSE transcripts checked against the log."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

import httpx
import openai
import pytest

from app.store.fleet import FleetStore
from statemachine import events as ev
from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.transcript import check_request, stream_chat
from tests.support.workers import WorkerProcess, running_worker

TOKEN = "fleet-admin-token-0123456789"
AUTH = {"authorization": f"Bearer {TOKEN}"}
# A change reaches another instance within the second on a quiet machine (measured in
# docs/performance.md); a loaded one may take longer, so the tests wait up to HEARD_S, with
# the periodic re-read put off: whatever arrives was heard by NOTIFY.
HEARD_S = 15.0
pytestmark = pytest.mark.usefixtures("heard_by_notify_only")
SLOW = ["--sim-decode-ms-per-token", "40", "--model", MODEL, "--heartbeat-ms", "100", "--max-model-len", "512"]


@contextlib.contextmanager
def two_gateways(database_url: str, **overrides: Any) -> Iterator[tuple[RunningGateway, RunningGateway]]:
    with (
        running_gateway(database_url, [], admin_token=TOKEN, **overrides) as a,
        running_gateway(database_url, [], admin_token=TOKEN, **overrides) as b,
    ):
        yield a, b


def wait_for(condition: Callable[[], object], timeout: float = HEARD_S) -> float:
    """Seconds until ``condition`` held."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, "not within the time allowed"
        time.sleep(0.005)
    return time.monotonic() - start


def add(gateway: RunningGateway, worker: WorkerProcess, replica_id: str, **extra: Any) -> httpx.Response:
    body = {"id": replica_id, "url": worker.base_url, "kind": "worker", "models": [MODEL], **extra}
    return httpx.post(f"{gateway.url}/admin/replicas", json=body, headers=AUTH, timeout=30)


def fleet_events(gateway: RunningGateway) -> list[dict[str, Any]]:
    return gateway.call(FleetStore(gateway.gateway.ctx.store).events(limit=1000))


def chat(gateway: RunningGateway, prompt: str, max_tokens: int = 4) -> str:
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens
    )
    assert raw.parse().choices[0].message.content
    return raw.headers["x-request-id"]


def replica_of(gateway: RunningGateway, request_id: str) -> list[str]:
    return [e.replica_id for e in gateway.events(request_id) if isinstance(e, ev.AttemptStarted)]


def test_a_replica_added_through_one_instance_serves_through_the_other(database_url: str) -> None:
    with two_gateways(database_url) as (a, b), running_worker(args=SLOW) as worker:
        assert httpx.get(f"{b.url}/readyz").status_code == 200  # an empty fleet is ready
        refused = b.openai().chat.completions.with_raw_response
        with pytest.raises(openai.APIStatusError) as caught:
            refused.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert (caught.value.status_code, caught.value.code) == (503, "no_replica_available")
        response = add(a, worker, "w1")
        assert response.status_code == 201, response.text
        assert response.json()["state"] == "serving" and response.json()["source"] == "admin"
        wait_for(lambda: "w1" in b.gateway.ctx.pool.replicas)
        request_id = chat(b, "through the other instance")
        assert replica_of(b, request_id) == ["w1"]
        listed = httpx.get(f"{b.url}/admin/replicas", headers=AUTH).json()
        (entry,) = listed["data"]
        assert (entry["id"], entry["kind"], entry["state"]) == ("w1", "worker", "serving")
        assert entry["url"] == worker.base_url and entry["live_attempts"] == 0
        model = {"name": MODEL, "revision": None, "configured_revision": "sim-rev-1", "current": True}
        assert entry["models"] == [model]
        assert [e["event"] for e in listed["events"]] == ["joined"]
        page = httpx.get(f"{b.url}/ui/requests", headers=AUTH)  # the list page shows the fleet
        assert page.status_code == 200 and 'data-replica="w1"' in page.text and "joined w1 (admin, admin" in page.text


def test_bad_bodies_and_tokens_change_nothing(database_url: str) -> None:
    with (
        running_gateway(database_url, [], admin_token=TOKEN) as gateway,
        running_worker(args=SLOW) as worker,
        running_worker(args=SLOW) as other,
    ):
        url = f"{gateway.url}/admin/replicas"
        assert httpx.get(url).status_code == 401
        assert httpx.get(url, headers={"authorization": "Bearer wrong"}).status_code == 401
        cases = [
            ({"id": "x", "url": worker.base_url, "kind": "grpc"}, 400, "invalid_kind"),
            ({"id": "x", "url": "ftp://nowhere"}, 400, "invalid_url"),
            ({"id": "../x", "url": worker.base_url}, 400, "invalid_replica_id"),
            ({"id": "x", "url": worker.base_url, "models": "sim"}, 400, "invalid_models"),
            ({"id": "x", "url": worker.base_url, "weights": 1}, 400, "invalid_body"),
            ({"id": "x", "url": worker.base_url, "models": ["not-served"]}, 422, "model_not_served"),
            ({"id": "x", "url": "http://127.0.0.1:9"}, 422, "replica_unreachable"),
            ({"id": "x", "url": worker.base_url, "kind": "openai", "models": [MODEL]}, 422, None),
            ([1, 2], 400, "invalid_body"),
            ({"id": "x", "url": "http://h\x00st:1"}, 400, "invalid_url"),
            ({"id": "x", "url": "http://[::1"}, 422, "replica_unreachable"),
            ({"id": "x", "url": worker.base_url, "models": ["s\x00m"]}, 400, "invalid_models"),
        ]
        for body, status, code in cases:
            response = httpx.post(url, json=body, headers=AUTH, timeout=30)
            assert response.status_code == status, (body, response.text)
            assert code is None or response.json()["error"]["code"] == code, (body, response.text)
        not_json = httpx.post(url, content=b"{", headers={**AUTH, "content-type": "application/json"})
        assert not_json.status_code == 400
        assert fleet_events(gateway) == []
        assert add(gateway, worker, "w1").status_code == 201
        assert add(gateway, other, "w1").json()["error"]["code"] == "replica_exists"
        for path, body in (("/admin/replicas/nope/cordon", None), ("/admin/replicas/nope/uncordon", None)):
            assert httpx.post(gateway.url + path, json=body, headers=AUTH).status_code == 404
        bad_drain = httpx.post(f"{url}/w1/cordon", json={"drain_s": -1}, headers=AUTH)
        assert bad_drain.json()["error"]["code"] == "invalid_drain"
        assert httpx.post(f"{url}/w1/uncordon", headers=AUTH).json()["error"]["code"] == "replica_not_cordoned"
        assert httpx.delete(f"{url}/w1?drain_s=x", headers=AUTH).status_code == 400
        assert [e["event"] for e in fleet_events(gateway)] == ["joined"]


def test_a_file_declared_replica_is_reconciled_once_and_cannot_be_deleted(database_url: str) -> None:
    with running_worker(args=SLOW) as worker:
        from app.config import ReplicaConfig

        declared = [ReplicaConfig(id="f1", url=worker.base_url)]
        with (
            running_gateway(database_url, declared, admin_token=TOKEN) as a,
            running_gateway(database_url, declared, admin_token=TOKEN) as b,
        ):
            events = fleet_events(a)
            assert [(e["event"], e["replica_id"], e["source"]) for e in events] == [("joined", "f1", "file")]
            assert "f1" in b.gateway.ctx.pool.replicas
            refused = httpx.delete(f"{b.url}/admin/replicas/f1", headers=AUTH)
            assert refused.status_code == 409 and refused.json()["error"]["code"] == "replica_declared"
            assert httpx.post(f"{b.url}/admin/replicas/f1/cordon", headers=AUTH).json()["state"] == "cordoned"
            # another declared source through the same entry point: only the lock's holder writes
            from app.store.fleet_model import DeclaredReplica

            leader, follower = (a, b) if a.gateway.fleet.listener.leading else (b, a)
            dns = [DeclaredReplica("d1", worker.base_url, models=((MODEL, None),))]
            assert follower.call(follower.gateway.fleet.reconcile("dns", dns)) is None
            written = leader.call(leader.gateway.fleet.reconcile("dns", dns))
            assert written is not None and [(w.event, w.replica_id, w.source) for w in written] == [
                ("joined", "d1", "dns")
            ]
            assert leader.call(leader.gateway.fleet.reconcile("dns", dns)) == []  # already as declared
            wait_for(lambda: "d1" in follower.gateway.ctx.pool.replicas)
            assert (
                httpx.delete(f"{a.url}/admin/replicas/d1", headers=AUTH).json()["error"]["code"] == "replica_declared"
            )


def run_streams(gateway: RunningGateway, count: int, max_tokens: int, prompt: str) -> list[Any]:
    bodies = [
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"{prompt} {n}"}],
            "max_tokens": max_tokens,
            "ignore_eos": True,  # every token asked for: no answer ends before the change meets it
        }
        for n in range(count)
    ]
    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(lambda body: stream_chat(gateway.url, body), bodies))


def test_a_cordon_lets_live_streams_end_and_places_nothing_new(database_url: str) -> None:
    with ExitStack() as stack:
        a, b = stack.enter_context(two_gateways(database_url))
        w1, w2 = (stack.enter_context(running_worker(args=[*SLOW, "--max-running", "64"])) for _ in range(2))
        assert add(a, w1, "w1").status_code == 201
        wait_for(lambda: "w1" in b.gateway.ctx.pool.replicas)
        with ThreadPoolExecutor(1) as background:
            streams = background.submit(run_streams, b, 20, 30, "cordoned while streaming")
            wait_for(lambda: b.gateway.ctx.pool.replicas["w1"].outstanding == 20)
            cordon = httpx.post(f"{a.url}/admin/replicas/w1/cordon", headers=AUTH)
            assert cordon.status_code == 200 and cordon.json()["state"] == "cordoned"
            assert add(a, w2, "w2").status_code == 201
            wait_for(lambda: b.gateway.ctx.pool.replicas["w1"].cordoned and "w2" in b.gateway.ctx.pool.replicas)
            after = [chat(b, f"after the cordon {n}") for n in range(3)]
            transcripts = streams.result(60)
        for transcript in transcripts:
            assert transcript.status == 200 and transcript.error is None and transcript.done
            state = check_request(b.events(transcript.request_id), transcript)
            assert state.replicas_tried == ("w1",)
        assert all(replica_of(b, request_id) == ["w2"] for request_id in after)
        cordoned = next(e for e in fleet_events(a) if e["event"] == "cordoned")
        assert cordoned["actor"] == "admin" and cordoned["instance_id"] == a.gateway.ctx.gateway_id and cordoned["at"]
        assert httpx.post(f"{b.url}/admin/replicas/w1/uncordon", headers=AUTH).json()["state"] == "serving"
        wait_for(lambda: not a.gateway.ctx.pool.replicas["w1"].cordoned)
        # w1 the least loaded again, whatever load its last health answer still reports
        a.gateway.ctx.pool.replicas["w2"].outstanding += 1000
        try:
            assert replica_of(a, chat(a, "uncordoned")) == ["w1"]
        finally:
            a.gateway.ctx.pool.replicas["w2"].outstanding -= 1000


def test_a_delete_with_a_short_drain_ends_each_stream_by_the_rule(database_url: str) -> None:
    with ExitStack() as stack:
        a, b = stack.enter_context(two_gateways(database_url))
        w1, w2 = (
            stack.enter_context(running_worker(faults=True, args=[*SLOW, "--max-running", "64"])) for _ in range(2)
        )
        from tests.app.conftest import add_fault

        # one attempt still in its prefill at the deadline: nothing sent yet, so it is retried
        add_fault(w1, action="slow_prefill", prefill_ms=20000, match={"prompt_contains": "drained 5"})
        assert add(a, w1, "w1").status_code == 201
        wait_for(lambda: "w1" in b.gateway.ctx.pool.replicas)
        with ThreadPoolExecutor(1) as background:
            streams = background.submit(run_streams, b, 6, 200, "drained")  # ~8 s each: longer than the drain
            wait_for(lambda: b.gateway.ctx.pool.replicas["w1"].outstanding == 6)
            replica = b.gateway.ctx.pool.replicas["w1"]
            assert add(a, w2, "w2").status_code == 201
            removed = httpx.delete(f"{a.url}/admin/replicas/w1?drain_s=0.5", headers=AUTH)
            assert removed.status_code == 202 and removed.json()["leaving"] is True
            transcripts = streams.result(60)
        for transcript in transcripts:
            events = b.events(transcript.request_id)
            state = check_request(events, transcript)  # the client and the log agree
            failed = [e for e in events if isinstance(e, ev.UpstreamFailed)]
            assert [e.upstream_code for e in failed] == ["replica_drained"]
            if state.first_delta_attempt == 1:  # drained after its first delta: the §6 error
                assert transcript.error is not None and transcript.error["code"] == "upstream_decode_interrupted"
            else:  # drained before it: retried on the other replica, which answered
                assert transcript.error is None and state.replicas_tried == ("w1", "w2")
                assert state.first_delta_attempt == 2 and transcript.finish_reason == "length"
        assert sum(t.error is not None for t in transcripts) == 5  # the five streaming
        assert sum(t.error is None for t in transcripts) == 1  # the one in its prefill, retried
        assert replica.consecutive_failures == 0  # a drain never counts toward ejection
        wait_for(lambda: any(e["event"] == "left" for e in fleet_events(a)))
        left = next(e for e in fleet_events(a) if e["event"] == "left")
        assert left["replica_id"] == "w1" and "drain deadline" in left["reason"]
        assert sum(1 for e in fleet_events(a) if e["event"] == "left") == 1


def test_the_replicas_command_adds_cordons_lists_and_removes(
    database_url: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from app import cli

    with running_gateway(database_url, [], admin_token=TOKEN) as gateway, running_worker(args=SLOW) as worker:
        base = ["replicas", "--gateway", gateway.url]
        monkeypatch.delenv("PHASEGATE_ADMIN_TOKEN", raising=False)
        monkeypatch.setenv("PHASEGATE_DATA_DIR", str(tmp_path / "data"))  # the embedded default's: none yet
        assert cli.main([*base, "list"]) == 2  # no token
        assert "no admin token" in capsys.readouterr().err
        (tmp_path / "data").mkdir()
        (tmp_path / "data" / "admin-token").write_text(TOKEN + "\n")  # as `phasegate serve` keeps it
        assert cli.main([*base, "list"]) == 0  # read from there: the demo's fleet, one command away
        assert capsys.readouterr().out.split() == ["ID", "STATE", "SOURCE", "KIND", "LIVE", "URL", "MODELS"]
        (tmp_path / "data" / "admin-token").write_text("another-token\n")
        assert cli.main([*base, "list"]) == 1  # a token the gateway does not take: its refusal
        assert "invalid_admin_token: incorrect admin token" in capsys.readouterr().err
        token_file = tmp_path / "token"
        token_file.write_text(TOKEN + "\n")
        assert (
            cli.main(
                [
                    *base,
                    "--admin-token-file",
                    str(token_file),
                    "add",
                    "w1",
                    worker.base_url,
                    "--model",
                    f"{MODEL}=rev-x",
                ]
            )
            == 0
        )
        assert capsys.readouterr().out.startswith("w1: serving")
        monkeypatch.setenv("PHASEGATE_ADMIN_TOKEN", TOKEN)
        assert cli.main([*base, "cordon", "w1", "--drain-s", "30"]) == 0
        assert capsys.readouterr().out.startswith("w1: cordoned")
        assert cli.main([*base, "list"]) == 0
        listed = capsys.readouterr().out.splitlines()
        assert listed[0].split()[:5] == ["ID", "STATE", "SOURCE", "KIND", "LIVE"]
        assert listed[1].split()[:5] == ["w1", "cordoned", "admin", "worker", "0"]
        assert f"{MODEL}=rev-x (not the configured revision)" in listed[1]
        assert cli.main([*base, "uncordon", "w1"]) == 0
        assert cli.main([*base, "uncordon", "w1"]) == 1
        assert "replica_not_cordoned" in capsys.readouterr().err
        assert cli.main([*base, "remove", "w1"]) == 0
        wait_for(lambda: next(e["event"] for e in fleet_events(gateway)) == "left")
        events = [(e["event"], e["actor"]) for e in reversed(fleet_events(gateway))]
        assert [event for event, _ in events] == ["joined", "cordoned", "uncordoned", "cordoned", "left"]
        assert {actor for _, actor in events[:-1]} == {"admin"}
        # the log says "left" first; the pool forgets the replica as it applies the event
        wait_for(lambda: "w1" not in gateway.gateway.ctx.pool.replicas)
        # metrics: changes by source and event; the series of a replica that left are dropped
        wait_for(lambda: gateway.metric("phasegate_fleet_changes_total", source="admin", event="left") == 1)
        assert gateway.metric("phasegate_fleet_changes_total", source="admin", event="cordoned") == 2
        scraped = httpx.get(f"{gateway.url}/metrics").text
        assert 'phasegate_replica_healthy{replica="w1"}' not in scraped
        assert f'phasegate_fleet_replicas{{model="{MODEL}",state="serving"}} 0.0' in scraped


def test_a_rolling_revision_never_retries_a_request_onto_other_weights(database_url: str) -> None:
    from tests.app.conftest import add_fault

    with ExitStack() as stack:
        old = stack.enter_context(running_gateway(database_url, [], admin_token=TOKEN, models={MODEL: "A"}))
        workers = {
            name: stack.enter_context(running_worker(faults=True, args=SLOW)) for name in ("a1", "a2", "b1", "b2")
        }
        for name, worker in workers.items():
            revision = name[0].upper()
            assert add(old, worker, name, models=[f"{MODEL}={revision}"]).status_code == 201
        listed = {r["id"]: r["models"][0] for r in httpx.get(f"{old.url}/admin/replicas", headers=AUTH).json()["data"]}
        assert [name for name, model in sorted(listed.items()) if model["current"]] == ["a1", "a2"]
        for name in ("a1", "a2"):  # every start of this prompt refused on the A replicas
            add_fault(workers[name], action="reject", status=503, match={"prompt_contains": "retry me"}, times=None)
        served = [chat(old, f"at revision A {n}") for n in range(4)]
        body = {"model": MODEL, "messages": [{"role": "user", "content": "retry me"}], "max_tokens": 3}
        refused = httpx.post(f"{old.url}/v1/chat/completions", json=body, timeout=30)
        assert refused.status_code in (502, 503), refused.text
        retried = refused.headers["x-request-id"]
        # the revision switched: a gateway serving B (a reload, on the fleet it shares)
        new = stack.enter_context(running_gateway(database_url, [], admin_token=TOKEN, models={MODEL: "B"}))
        at_b = [chat(new, f"at revision B {n}") for n in range(4)]
        for name in ("a1", "a2"):  # A drains
            assert httpx.post(f"{new.url}/admin/replicas/{name}/cordon", headers=AUTH).status_code == 200
        wait_for(lambda: all(old.gateway.ctx.pool.replicas[n].cordoned for n in ("a1", "a2")))
        drained = httpx.post(
            f"{old.url}/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "late A"}]}
        )
        assert drained.status_code == 503 and drained.json()["error"]["code"] == "no_replica_available"
        # per request, in the log: every attempt on a replica of the recorded revision
        for gateway, request_ids in ((old, [*served, retried]), (new, at_b)):
            for request_id in request_ids:
                events = gateway.events(request_id)
                (accepted,) = [e for e in events if isinstance(e, ev.RequestAccepted)]
                replicas = [e.replica_id for e in events if isinstance(e, ev.AttemptStarted)]
                assert replicas and all(r[0].upper() == accepted.model_revision for r in replicas), (
                    request_id,
                    replicas,
                )
        assert replica_of(old, retried) == ["a1", "a2"] or replica_of(old, retried) == ["a2", "a1"]
