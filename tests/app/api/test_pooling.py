"""Pooling requests through the gateway (docs/design.md §17), with real parts: a real gateway
in front of scripted OpenAI-compatible upstreams in their own processes (their pooling answers
are the sim engine's, app/worker/sim_pooling.py), the real ``openai`` client and langchain's
``OpenAIEmbeddings``, and the log read back from PostgreSQL."""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from app.cli import main as cli_main
from app.config import ReplicaConfig
from app.worker import sim_pooling
from statemachine import events as ev
from statemachine.events import FailureKind
from statemachine.jsonform import to_json
from statemachine.replay import replay
from statemachine.request_state import Outcome
from statemachine.state import fold
from tests.support.audit import fetch_sql
from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.scripted_upstream import ScriptedUpstream, running_scripted_upstream


@pytest.fixture(scope="module")
def upstreams() -> Iterator[tuple[ScriptedUpstream, ScriptedUpstream]]:
    with running_scripted_upstream() as first, running_scripted_upstream() as second:
        yield first, second


@pytest.fixture
def gateway(database_url: str, upstreams: tuple[ScriptedUpstream, ScriptedUpstream]) -> Iterator[RunningGateway]:
    for upstream in upstreams:
        upstream.script()  # nothing queued from an earlier test
    replicas = [
        ReplicaConfig(id=f"u{i}", url=upstream.base_url, kind="openai") for i, upstream in enumerate(upstreams, 1)
    ]
    with running_gateway(database_url, replicas, content_policy="full") as running:
        yield running


def post(gateway: RunningGateway, path: str, json: dict[str, Any], **options: Any) -> httpx.Response:
    with gateway.http() as http:
        return http.post(path, json=json, **options)


def logged(gateway: RunningGateway, request_id: str) -> list[ev.Event]:
    gateway.wait_logged(request_id, lambda events: fold(events).outcome is not None)
    events = gateway.logged(request_id)
    result = replay(events)
    assert result.ok, result.divergence and result.divergence.describe()
    return events


def test_embeddings_create_through_the_openai_client_answers_the_replicas_vectors_and_logs_the_request(
    gateway: RunningGateway,
) -> None:
    raw = gateway.openai().embeddings.with_raw_response.create(model=MODEL, input=["a b c", "d"])
    created = raw.parse()
    assert [item.embedding for item in created.data] == [
        sim_pooling.vector(MODEL, "a b c"),
        sim_pooling.vector(MODEL, "d"),
    ]
    assert created.usage.prompt_tokens == 4
    events = logged(gateway, raw.headers["x-request-id"])
    accepted = events[0]
    assert isinstance(accepted, ev.RequestAccepted) and accepted.endpoint == "/v1/embeddings"
    state = fold(events)
    assert state.outcome is Outcome.COMPLETED and len(state.attempts) == 1
    assert not any(isinstance(event, ev.FirstDeltaCommitted | ev.DeltasDelivered) for event in events)
    completed = events[-1]
    assert isinstance(completed, ev.RequestCompleted) and completed.usage["prompt_tokens"] == 4
    # the vectors are in no event of the log
    assert str(sim_pooling.vector(MODEL, "d")[0]) not in json.dumps([to_json(event) for event in events])


BODIES = {
    "/v1/embeddings": {"input": [[1, 2, 3], [4]], "dimensions": 8},
    "/v2/embed": {"texts": ["a b", "c"], "embedding_types": ["float", "base64"]},
    "/pooling": {"messages": [{"role": "user", "content": "a chat"}]},
    "/classify": {"input": "a b c", "truncate_prompt_tokens": 3},
    "/score": {"queries": "q", "documents": ["d1", "d2"]},
    "/v1/score": {"text_1": ["a", "b"], "text_2": ["c", "d"]},
    "/rerank": {"query": "q", "documents": ["d1", "d2", "d3"], "top_n": 2},
    "/v1/rerank": {"query": "q", "documents": [{"content": [{"type": "text", "text": "d"}]}]},
    "/v2/rerank": {"query": "q", "documents": ["x"]},
}


@pytest.mark.parametrize("path", list(BODIES))
def test_every_pooling_route_is_passed_on_on_its_own_path_and_answered_as_the_replica_answered(
    gateway: RunningGateway, upstreams: tuple[ScriptedUpstream, ScriptedUpstream], path: str
) -> None:
    body = {"model": MODEL, **BODIES[path]}
    response = post(gateway, path, json=body)
    assert response.status_code == 200, response.text
    request_id = response.headers["x-request-id"]
    expected, _ = sim_pooling.answer(path, body, MODEL, f"{request_id}.1", 0)
    answered = response.json()
    for volatile in ("id", "created"):
        answered.pop(volatile, None), expected.pop(volatile, None)
    assert answered == expected
    received = [upstream.last_body for upstream in upstreams]
    assert body in received  # the client's body, as it sent it
    events = logged(gateway, request_id)
    accepted = events[0]
    assert isinstance(accepted, ev.RequestAccepted) and accepted.endpoint == path and accepted.stream is False
    completed = events[-1]
    assert isinstance(completed, ev.RequestCompleted) and completed.usage["prompt_tokens"] > 0


@pytest.mark.parametrize("encoding", ["bytes", "bytes_only", "base64"])
def test_an_embeddings_encoding_is_the_replicas_bytes_with_its_metadata_header(
    gateway: RunningGateway, encoding: str
) -> None:
    body = {"model": MODEL, "input": ["one", "two words"], "encoding_format": encoding}
    response = post(gateway, "/v1/embeddings", json=body)
    assert response.status_code == 200, response.text
    vectors = [sim_pooling.vector(MODEL, "one"), sim_pooling.vector(MODEL, "two words")]
    packed = [struct.pack(f"<{len(v)}f", *v) for v in vectors]
    if encoding == "base64":
        assert [base64.b64decode(item["embedding"]) for item in response.json()["data"]] == packed
        return
    assert response.headers["content-type"] == "application/octet-stream"
    assert response.content == b"".join(packed)
    if encoding == "bytes_only":
        assert "metadata" not in response.headers
        return
    metadata = json.loads(response.headers["metadata"])
    assert [(item["start"], item["end"]) for item in metadata["data"]] == [(0, 64), (64, 128)]
    assert metadata["usage"]["prompt_tokens"] == 3
    events = logged(gateway, response.headers["x-request-id"])
    completed = events[-1]
    assert isinstance(completed, ev.RequestCompleted) and completed.usage["prompt_tokens"] == 3


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/embeddings", {"input": 5}, "input"),
        ("/v1/embeddings", {}, "input"),
        ("/v1/embeddings", {"input": "a", "encoding_format": "hex"}, "encoding_format"),
        ("/v1/embeddings", {"input": "a", "normalize": True}, "normalize"),
        ("/v1/embeddings", {"input": "a", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ("/v2/embed", {"texts": []}, "texts"),
        ("/pooling", {"input": "a", "task": "generate"}, "task"),
        ("/classify", {"input": [1.5]}, "input"),
        ("/score", {"queries": "q"}, "queries"),
        ("/rerank", {"documents": ["d"]}, "query"),
        ("/v2/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, "top_n"),
        # named by its path, not by pydantic's label of the union's member it failed in
        ("/v1/embeddings", {"messages": [{"role": "user", "content": [{"text": 3}]}]}, "messages[0].content"),
    ],
)
def test_a_body_its_route_does_not_take_is_a_400_naming_the_field_and_reaches_no_replica(
    gateway: RunningGateway, upstreams: tuple[ScriptedUpstream, ScriptedUpstream], path: str, body: dict, param: str
) -> None:
    asked = sum(upstream.requests for upstream in upstreams)
    response = post(gateway, path, json={"model": MODEL, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_request" and error["param"] == param and error["type"] == "invalid_request_error"
    assert response.headers["x-should-retry"] == "false"
    assert sum(upstream.requests for upstream in upstreams) == asked


def test_an_unknown_model_and_an_idempotency_key_are_refused_by_name(gateway: RunningGateway) -> None:
    unknown = post(gateway, "/v1/embeddings", json={"model": "nope", "input": "a"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    keyed = post(gateway, "/v1/embeddings", json={"input": "a"}, headers={"idempotency-key": "k1"})
    assert keyed.status_code == 400 and keyed.json()["error"]["param"] == "Idempotency-Key"


def test_a_replica_that_refuses_a_pooling_request_as_invalid_gives_the_client_its_400_and_is_not_ejected(
    gateway: RunningGateway, upstreams: tuple[ScriptedUpstream, ScriptedUpstream]
) -> None:
    refusal = {"status": 400, "message": "This model's maximum context length is 8 tokens", "param": "input"}
    for upstream in upstreams:  # wherever the attempt lands
        upstream.script(refusal)
    asked = sum(upstream.requests for upstream in upstreams)
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.openai().embeddings.create(model=MODEL, input="far too long")
    assert "maximum context length" in caught.value.message and caught.value.param == "input"
    assert caught.value.response.headers["x-should-retry"] == "false"
    assert sum(upstream.requests for upstream in upstreams) - asked == 1  # not retried
    for upstream in upstreams:
        upstream.script()
    events = logged(gateway, caught.value.response.headers["x-request-id"])
    (failed,) = [event for event in events if isinstance(event, ev.UpstreamFailed)]
    assert failed.kind is FailureKind.REQUEST_REFUSED and failed.upstream_status == 400
    assert fold(events).outcome is Outcome.FAILED
    pool = gateway.gateway.ctx.pool
    assert [replica.consecutive_failures for replica in pool.replicas.values()] == [0, 0]
    assert all(replica.ejected_until == 0 for replica in pool.replicas.values())
    again = gateway.openai().embeddings.create(model=MODEL, input="short")  # both still serve
    assert again.data[0].embedding == sim_pooling.vector(MODEL, "short")


def test_langchains_openai_embeddings_through_the_gateway(gateway: RunningGateway) -> None:
    from langchain_openai import OpenAIEmbeddings

    embeddings = OpenAIEmbeddings(
        model=MODEL,
        base_url=gateway.url + "/v1",
        api_key="unused",  # type: ignore[arg-type]
        check_embedding_ctx_length=False,  # texts as they are: no tiktoken download
    )
    assert embeddings.embed_documents(["first text", "second"]) == [
        sim_pooling.vector(MODEL, "first text"),
        sim_pooling.vector(MODEL, "second"),
    ]
    assert embeddings.embed_query("a query") == sim_pooling.vector(MODEL, "a query")


ADMIN_TOKEN = "pooling-admin-token"


def test_the_request_list_the_timeline_the_read_model_and_replay_know_a_pooling_request(
    database_url: str, upstreams: tuple[ScriptedUpstream, ScriptedUpstream], monkeypatch: pytest.MonkeyPatch
) -> None:
    replicas = [ReplicaConfig(id=f"u{i}", url=u.base_url, kind="openai") for i, u in enumerate(upstreams, 1)]
    with running_gateway(database_url, replicas, admin_token=ADMIN_TOKEN) as gateway:
        answered = post(gateway, "/v2/rerank", {"model": MODEL, "query": "q", "documents": ["a", "b"]})
        request_id = answered.headers["x-request-id"]
        logged(gateway, request_id)
        with gateway.http(headers={"authorization": f"Bearer {ADMIN_TOKEN}"}) as http:
            listing = http.get("/ui/requests")
            timeline = http.get(f"/ui/requests/{request_id}")
    assert listing.status_code == 200 and f'data-request="{request_id}"' in listing.text
    assert timeline.status_code == 200 and request_id in timeline.text
    (row,) = fetch_sql(database_url, "SELECT * FROM requests WHERE request_id = :id", id=request_id)
    # its prompt tokens there are the accept's estimate (three characters: one token)
    assert (row["endpoint"], row["outcome"], row["attempts"], row["prompt_tokens"]) == ("/v2/rerank", "completed", 1, 1)
    monkeypatch.setenv("DATABASE_URL", database_url)
    assert cli_main(["replay", "-q", request_id]) == 0


@pytest.mark.parametrize("policy", ["full", "digest"])
def test_a_pooling_requests_input_is_kept_under_the_content_policy(
    database_url: str, upstreams: tuple[ScriptedUpstream, ScriptedUpstream], policy: str
) -> None:
    replicas = [ReplicaConfig(id=f"u{i}", url=u.base_url, kind="openai") for i, u in enumerate(upstreams, 1)]
    body = {"model": MODEL, "input": ["a private text"]}
    with running_gateway(database_url, replicas, content_policy=policy) as gateway:
        request_id = post(gateway, "/v1/embeddings", body).headers["x-request-id"]
        logged(gateway, request_id)
        kept = gateway.call(gateway.gateway.ctx.store.read_input(request_id))
    assert kept is not None
    if policy == "full":
        assert kept.body == body
    else:
        assert "private" not in json.dumps(kept.body) and set(kept.body) == {"sha256"}


def test_a_pooling_request_has_no_stream_to_resume(gateway: RunningGateway) -> None:
    request_id = post(gateway, "/v1/embeddings", {"input": "a"}).headers["x-request-id"]
    logged(gateway, request_id)
    with gateway.http() as http:
        resumed = http.get(f"/v1/requests/{request_id}/stream")
    assert resumed.status_code == 409 and resumed.json()["error"]["code"] == "resume_unavailable"
    assert "pooling request" in resumed.json()["error"]["message"]
