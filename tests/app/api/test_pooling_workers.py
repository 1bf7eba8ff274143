"""Pooling requests through worker replicas (docs/design.md §17): each attempt a pooling
attempt of the worker protocol, answered by the sim engine's deterministic vectors
(app/worker/sim_pooling.py). Real sim workers in their own processes, a real gateway on
PostgreSQL, the real ``openai`` client; faults scripted on the workers."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest

from app.worker import sim_pooling
from statemachine import events as ev
from statemachine.events import FailureKind
from statemachine.replay import replay
from statemachine.request_state import Outcome
from statemachine.state import fold
from tests.app.api.test_pooling import BODIES
from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.transcript import of
from tests.support.workers import WorkerProcess


@pytest.fixture
def gateway(database_url: str, sim_pair: list[WorkerProcess]) -> Iterator[RunningGateway]:
    with running_gateway(database_url, sim_pair) as running:
        yield running


def judged(gateway: RunningGateway, request_id: str) -> list[ev.Event]:
    gateway.wait_logged(request_id, lambda events: fold(events).outcome is not None)
    events = gateway.logged(request_id)
    result = replay(events)
    assert result.ok, result.divergence and result.divergence.describe()
    return events


@pytest.mark.parametrize("path", list(BODIES))
def test_every_pooling_route_is_a_pooling_attempt_of_a_worker(gateway: RunningGateway, path: str) -> None:
    body = {"model": MODEL, **BODIES[path]}
    with gateway.http() as http:
        response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    request_id = response.headers["x-request-id"]
    expected, _ = sim_pooling.answer(path, body, MODEL, request_id, 0)
    answered = response.json()
    for volatile in ("id", "created"):
        answered.pop(volatile, None), expected.pop(volatile, None)
    assert answered == expected
    events = judged(gateway, request_id)
    assert events[0].endpoint == path  # type: ignore[attr-defined]
    assert fold(events).outcome is Outcome.COMPLETED
    (completed,) = of(events, ev.RequestCompleted)
    assert completed.usage["prompt_tokens"] == sim_pooling.prompt_tokens(expected, {}) > 0  # type: ignore[attr-defined]


def test_an_embeddings_bytes_answer_comes_through_a_worker_as_its_bytes(gateway: RunningGateway) -> None:
    body = {"model": MODEL, "input": ["one", "two"], "encoding_format": "bytes"}
    with gateway.http() as http:
        response = http.post("/v1/embeddings", json=body)
    assert response.status_code == 200, response.text
    expected, _ = sim_pooling.answer("/v1/embeddings", body, MODEL, "r", 0)
    assert response.content == expected and response.headers["content-type"] == "application/octet-stream"
    metadata = json.loads(response.headers["metadata"])
    assert [(item["start"], item["end"]) for item in metadata["data"]] == [(0, 64), (64, 128)]
    created = gateway.openai().embeddings.create(model=MODEL, input="x")
    assert created.data[0].embedding == sim_pooling.vector(MODEL, "x")  # the SDK's base64, decoded


def test_a_worker_killed_during_a_pooling_request_is_retried_and_the_client_gets_one_answer(
    database_url: str, fresh_pair: list[WorkerProcess]
) -> None:
    marker = f"killed-{uuid.uuid4().hex[:8]}"
    fault = {"action": "die", "point": "prefill", "at_token": 0, "match": {"prompt_contains": marker, "attempt": 1}}
    for worker in fresh_pair:
        httpx.post(worker.base_url + "/admin/faults", json=fault, timeout=5).raise_for_status()
    with running_gateway(database_url, fresh_pair) as gateway:
        raw = gateway.openai(max_retries=0).embeddings.with_raw_response.create(model=MODEL, input=[marker, "b"])
        created = raw.parse()
        events = judged(gateway, raw.headers["x-request-id"])
    assert [item.embedding for item in created.data] == [
        sim_pooling.vector(MODEL, marker),
        sim_pooling.vector(MODEL, "b"),
    ]
    assert [worker.alive() for worker in fresh_pair].count(False) == 1
    started = of(events, ev.AttemptStarted)
    assert len(started) == 2 and started[0].replica_id != started[1].replica_id  # type: ignore[attr-defined]
    (failed,) = of(events, ev.UpstreamFailed)
    assert failed.kind is FailureKind.REPLICA_EXITED  # type: ignore[attr-defined]
    assert fold(events).outcome is Outcome.COMPLETED
    assert not of(events, ev.FirstDeltaCommitted) and not of(events, ev.DeltasDelivered)


def test_a_worker_that_refuses_a_pooling_request_as_invalid_gives_its_400_and_is_not_ejected(
    gateway: RunningGateway,
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.openai(max_retries=0).embeddings.create(model=MODEL, input="a", dimensions=sim_pooling.DIMENSIONS + 1)
    assert caught.value.param == "dimensions" and "at most" in caught.value.message
    events = judged(gateway, caught.value.response.headers["x-request-id"])
    assert len(of(events, ev.AttemptStarted)) <= 1  # refused at its start: no retry
    assert fold(events).outcome is Outcome.FAILED
    pool = gateway.gateway.ctx.pool
    assert [replica.consecutive_failures for replica in pool.replicas.values()] == [0, 0]
    assert all(replica.ejected_until == 0 for replica in pool.replicas.values())


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [  # a content part whose text is not a string (the gateway passes parts on as given): the
        # sim raised TypeError, a 500, and the request was poison (fuzz, CI)
        ("/rerank", {"query": "q", "documents": ["a", {"content": [{"type": "text", "text": [1]}]}]}, "documents"),
        ("/v1/score", {"text_1": {"content": [{"type": "text", "text": {}}]}, "text_2": "b"}, "text_1"),
    ],
)
def test_a_score_input_the_worker_cannot_read_is_its_400_naming_the_field_not_a_server_error(
    gateway: RunningGateway, path: str, body: dict[str, object], param: str
) -> None:
    answer = httpx.post(gateway.url + path, json={"model": MODEL, **body}, timeout=30)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param and "must be a string" in answer.json()["error"]["message"]
    events = judged(gateway, answer.headers["x-request-id"])
    assert len(of(events, ev.AttemptStarted)) == 1  # the replica's refusal is the client's: no retry
    assert all(replica.consecutive_failures == 0 for replica in gateway.gateway.ctx.pool.replicas.values())
