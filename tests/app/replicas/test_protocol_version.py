"""The worker protocol's version, between real processes: a gateway and a worker that speak
different versions refuse each other before an attempt starts, and the operator reads why
(app/contract/worker_protocol.py).

The workers here are real sim workers, which speak this build's version. The gateway runs
in the test's process, so a newer gateway is this build with its version raised: it sends
the raised version on every call and expects it in every health answer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import httpx
import pytest

from app.config import ReplicaConfig
from app.contract import worker_protocol
from statemachine import events as ev
from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.scripted_upstream import running_scripted_upstream
from tests.support.transcript import of
from tests.support.workers import WorkerProcess

NEWER = worker_protocol.VERSION + 1


def start_body(request_id: str) -> dict[str, object]:
    return {
        "request_id": request_id,
        "attempt": 1,
        "lease_epoch": 1,
        "lease_ttl_ms": 5000,
        "model": MODEL,
        "prompt": "hello",
        "params": {"max_tokens": 2},
    }


def wait_for(condition: Callable[[], bool], timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def test_a_worker_names_its_version_and_refuses_a_call_naming_another(sim_pair: list[WorkerProcess]) -> None:
    worker = sim_pair[0]
    health = httpx.get(worker.base_url + "/v1/health", timeout=10).json()
    info = httpx.get(worker.base_url + "/v1/info", timeout=10).json()
    assert health["protocol"] == info["protocol"] == worker_protocol.VERSION
    refused = httpx.post(
        worker.base_url + "/v1/attempts",
        json=start_body("pv-refused"),
        headers={worker_protocol.HEADER: str(NEWER)},
        timeout=10,
    )
    assert refused.status_code == 503
    error = refused.json()["error"]
    assert (error["code"], error["field"]) == ("protocol_mismatch", worker_protocol.HEADER)
    assert f"speaks protocol {worker_protocol.VERSION}" in error["message"] and repr(str(NEWER)) in error["message"]
    # nothing of it started: the worker holds no attempt of that request
    attempts = httpx.get(worker.base_url + "/admin/attempts", timeout=10).json()["attempts"]
    assert not [a for a in attempts if a["request_id"] == "pv-refused"]
    # the same start naming this version, or none (by hand), is served
    for headers in ({worker_protocol.HEADER: str(worker_protocol.VERSION)}, {}):
        served = httpx.post(worker.base_url + "/v1/attempts", json=start_body(f"pv-{len(headers)}"), headers=headers)
        assert served.status_code == 200 and b'"type":"done"' in served.content.replace(b" ", b"")


def test_a_gateway_of_another_version_uses_no_such_worker_and_says_why(
    database_url: str,
    sim_pair: list[WorkerProcess],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="phasegate.pool")
    monkeypatch.setattr(worker_protocol, "VERSION", NEWER)
    with running_scripted_upstream() as upstream:
        replicas = [
            ReplicaConfig(id="old-worker", url=sim_pair[0].base_url, kind="worker"),
            ReplicaConfig(id="server", url=upstream.base_url, kind="openai"),
        ]
        with running_gateway(database_url, replicas) as gateway:
            old = gateway.gateway.ctx.pool.replicas["old-worker"]
            assert wait_for(lambda: old.incompatible is not None)
            reason = f"it speaks worker protocol {NEWER - 1}; this gateway speaks {NEWER}"
            assert old.incompatible == reason and old.healthy is False
            # the operator: ready (the other replica serves), with the worker named and why
            ready = httpx.get(gateway.url + "/readyz", timeout=10)
            assert ready.status_code == 200
            assert ready.json() == {"status": "ready", "problems": [f"replica old-worker not used: {reason}"]}
            assert [r.getMessage() for r in caplog.records] == [f"replica old-worker is not used: {reason}"]
            # the client: every request answered, by the replica that speaks it, the worker never tried
            for _ in range(3):
                request_id = ask(gateway)
                events = gateway.events(request_id)
                assert [e.replica_id for e in of(events, ev.AttemptStarted)] == ["server"]  # type: ignore[attr-defined]
                assert of(events, ev.RequestCompleted)


def test_with_only_workers_of_another_version_the_gateway_is_unready_and_says_why(
    database_url: str, sim_pair: list[WorkerProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(worker_protocol, "VERSION", NEWER)
    with running_gateway(database_url, sim_pair) as gateway:
        pool = gateway.gateway.ctx.pool
        assert wait_for(lambda: all(r.incompatible for r in pool.replicas.values()))
        ready = httpx.get(gateway.url + "/readyz", timeout=10)
        assert ready.status_code == 503
        reason = f"it speaks worker protocol {NEWER - 1}; this gateway speaks {NEWER}"
        assert ready.json()["problems"] == [
            "no healthy replica",
            f"replica w1 not used: {reason}",
            f"replica w2 not used: {reason}",
        ]
        with gateway.http() as http:
            answer = http.post("/v1/chat/completions", json=chat_body())
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "no_replica_available"


def chat_body() -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def ask(gateway: RunningGateway) -> str:
    with gateway.http() as http:
        answer = http.post("/v1/chat/completions", json=chat_body())
    assert answer.status_code == 200, answer.text
    return answer.headers["x-request-id"]
