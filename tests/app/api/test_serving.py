"""Serving through the gateway with the real openai client and raw SSE, judged by the log too."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import asyncpg
import httpx
import openai
import pytest

from app.store.database import asyncpg_dsn
from statemachine import events as ev
from statemachine.phases import Phase
from statemachine.request_state import Outcome
from statemachine.state import fold
from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.workers import WorkerProcess

MESSAGES = [{"role": "user", "content": "Tell me about phases"}]


def names(events: list[ev.Event]) -> list[str]:
    return [type(e).__name__ for e in events]


def delivered_text(events: list[ev.Event]) -> str:
    return "".join(e.text or "" for e in events if isinstance(e, ev.DeltasDelivered))


def test_streamed_chat_with_the_openai_client(gateway: RunningGateway) -> None:
    client = gateway.openai()
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True, max_tokens=12, seed=5, stream_options={"include_usage": True}
    )
    request_id = stream.response.headers["x-request-id"]
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    events = gateway.events(request_id)
    state = fold(events)
    assert state.outcome is Outcome.COMPLETED and state.delivered_output_tokens == 12
    assert delivered_text(events) == text  # exactly what the client received
    order = names(events)
    assert order[:3] == ["RequestAccepted", "Decided", "AttemptStarted"]
    assert order.index("FirstTokenReceived") < order.index("FirstDeltaCommitted") < order.index("DeltasDelivered")
    assert order[-1] == "RequestCompleted"
    accepted = events[0]
    assert isinstance(accepted, ev.RequestAccepted)
    assert (accepted.model, accepted.tenant, accepted.stream, accepted.seed) == (MODEL, "default", True, 5)


def test_non_streamed_chat_gives_the_same_answer(gateway: RunningGateway) -> None:
    client = gateway.openai()
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=12, seed=5)
    completion = raw.parse()
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, max_tokens=12, seed=5)
        if c.choices
    )
    assert completion.choices[0].message.content == streamed
    assert completion.object == "chat.completion" and completion.usage is not None
    events = gateway.events(raw.headers["x-request-id"])
    assert fold(events).outcome is Outcome.COMPLETED
    assert delivered_text(events) == streamed


def test_legacy_completions_streamed_and_not(gateway: RunningGateway) -> None:
    client = gateway.openai()
    whole = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=6, seed=1)
    parts = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=6, seed=1, stream=True)
    assert "".join(c.choices[0].text for c in parts) == whole.choices[0].text != ""
    assert whole.object == "text_completion"


def test_raw_sse_has_ids_a_final_chunk_and_done(gateway: RunningGateway) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "stream": True, "max_tokens": 4}
    with gateway.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-request-id"].startswith("req_")
        raw = response.read().decode()
    events = [block for block in raw.split("\n\n") if block.strip()]
    assert events[-1] == "data: [DONE]"
    # as vLLM streams it: the choice opens with its role and no text; that chunk has no id
    # (event ids are delta indexes, for resuming), every other one has the next
    opening = json.loads(events[0].removeprefix("data: "))
    assert opening["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    ids = [block.split("\n")[0] for block in events[1:-1]]
    assert ids == [f"id: {n}" for n in range(len(ids))]
    payloads = [json.loads(block.split("data: ", 1)[1]) for block in events[1:-1]]
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(1 for p in payloads if p["choices"][0]["delta"].get("content")) == 4


def test_models_health_readiness_and_metrics(gateway: RunningGateway) -> None:
    with gateway.http() as http:
        models = http.get("/v1/models").json()
        assert models["data"][0]["id"] == MODEL and models["object"] == "list"
        assert models["data"][0]["max_model_len"] == 512  # as the worker serving it says (--max-model-len)
        assert http.get("/healthz").json() == {"status": "ok"}
        assert http.get("/readyz").json() == {"status": "ready"}
        gateway.openai().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
        metrics = http.get("/metrics").text
    assert f'phasegate_requests_total{{model="{MODEL}",outcome="completed"}} 1.0' in metrics
    assert "phasegate_time_to_first_token_seconds_bucket" in metrics
    assert 'phasegate_replica_healthy{replica="w1"} 1.0' in metrics


def test_a_choice_of_n_streams_every_choice(gateway: RunningGateway) -> None:
    client = gateway.openai()
    completion = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, n=2, seed=3)
    assert [c.index for c in completion.choices] == [0, 1]
    streamed: dict[int, str] = {0: "", 1: ""}
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, n=2, seed=3, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == {c.index: c.message.content for c in completion.choices}


def test_tool_calls_reach_the_client_with_the_gateways_ids(gateway: RunningGateway) -> None:
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, tools=tools, max_tokens=5
    )
    completion = raw.parse()
    (call,) = completion.choices[0].message.tool_calls or []
    assert call.function.name == "lookup" and call.id.startswith("call_")
    assert completion.choices[0].finish_reason == "tool_calls"
    events = gateway.events(raw.headers["x-request-id"])
    (emitted,) = [e for e in events if isinstance(e, ev.ToolCallEmitted)]
    assert emitted.tool_call_id == call.id
    assert emitted.idempotency_key == f"{raw.headers['x-request-id']}:{call.id}"


# --- bad input: a clear error, a stable code, nothing reaches a replica ------------------


def attempts_on(workers: list[WorkerProcess]) -> int:
    total = 0
    for worker in workers:
        for line in httpx.get(worker.base_url + "/metrics").text.splitlines():
            if line.startswith("phasegate_worker_attempts_started_total"):
                total += int(float(line.split()[-1]))
    return total


BAD_INPUTS: list[tuple[str, Any, dict[str, str], int, str, str | None]] = [
    ("malformed json", b"{not json", {}, 400, "invalid_json", None),
    ("not an object", [1, 2], {}, 400, "invalid_request", None),
    (
        "not unicode",
        b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}' % MODEL.encode(),
        {},
        400,
        "invalid_json",
        None,
    ),
    ("wrong type", {"model": MODEL, "messages": "hi"}, {}, 400, "invalid_request", "messages"),
    ("unknown model", {"model": "gpt-9", "messages": MESSAGES}, {}, 404, "model_not_found", "model"),
    (
        "max_tokens not a number",
        {"model": MODEL, "messages": MESSAGES, "max_tokens": "many"},
        {},
        400,
        "invalid_request",
        "max_tokens",
    ),
    (
        "max_tokens zero",
        {"model": MODEL, "messages": MESSAGES, "max_tokens": 0},
        {},
        400,
        "invalid_request",
        "max_tokens",
    ),
    (
        "phasegate's own",
        {"model": MODEL, "messages": MESSAGES, "priority": -10},
        {},
        400,
        "unsupported_parameter",
        "priority",
    ),
    (
        "a passed-on field of the wrong type",
        {"model": MODEL, "messages": MESSAGES, "logit_bias": ["42"]},
        {},
        400,
        "invalid_request",
        "logit_bias",
    ),
    (
        "too large",
        {"model": MODEL, "messages": [{"role": "user", "content": "x" * (1 << 20)}]},
        {},
        413,
        "request_too_large",
        None,
    ),
]


@pytest.mark.parametrize(
    ("case", "body", "headers", "status", "code", "param"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS]
)
def test_bad_input_gets_an_openai_error_and_reaches_no_replica(
    gateway: RunningGateway,
    sim_pair: list[WorkerProcess],
    case: str,
    body: Any,
    headers: dict[str, str],
    status: int,
    code: str,
    param: str | None,
) -> None:
    before = attempts_on(sim_pair)
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    with gateway.http() as http:
        response = http.post(
            "/v1/chat/completions", content=content, headers={"content-type": "application/json", **headers}
        )
    assert response.status_code == status
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (code, param)
    assert error["request_id"] == response.headers["x-request-id"] and error["message"]
    assert attempts_on(sim_pair) == before
    assert gateway.events(response.headers["x-request-id"]) == []  # nothing logged for it
    assert gateway.metric("phasegate_requests_rejected_total", code=code) == 1


def test_the_openai_client_raises_typed_errors_for_bad_input(gateway: RunningGateway) -> None:
    client = gateway.openai()
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="nope", messages=MESSAGES)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=-1)
    assert bad.value.code == "invalid_request" and bad.value.param == "temperature"


def test_a_request_without_model_gets_the_one_model_served_else_a_400_naming_them(
    gateway: RunningGateway, database_url: str, sim_pair: list[WorkerProcess]
) -> None:
    """As ``vllm serve`` takes its own model for a body that names none: where phasegate
    serves one, that one, logged as the request's; where it serves several, 400 naming them."""
    with gateway.http() as http:
        answered = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 3})
        completed = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "model": None})
        responded = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 3})
    for response in (answered, completed, responded):
        assert response.status_code == 200 and response.json()["model"] == MODEL
    accepted = gateway.events(answered.headers["x-request-id"])[0]
    assert isinstance(accepted, ev.RequestAccepted) and accepted.model == MODEL
    with (
        running_gateway(database_url, sim_pair, models={MODEL: "r1", "other": "r2"}) as several,
        several.http() as http,
    ):
        refused = http.post("/v1/chat/completions", json={"messages": MESSAGES})
    error = refused.json()["error"]
    assert refused.status_code == 400 and (error["code"], error["param"]) == ("model_required", "model")
    assert f"({MODEL}, other)" in error["message"] or f"(other, {MODEL})" in error["message"]


def test_unknown_routes_and_methods_are_openai_errors(gateway: RunningGateway) -> None:
    with gateway.http() as http:
        assert http.get("/v1/nothing").json()["error"]["code"] == "not_found"
        assert http.get("/v1/chat/completions").json()["error"]["code"] == "method_not_allowed"


def test_api_keys_map_to_tenants(database_url: str, sim_pair: list[WorkerProcess]) -> None:
    with running_gateway(database_url, sim_pair, api_keys={"key-a": "tenant-a"}) as gateway:
        with pytest.raises(openai.AuthenticationError) as wrong:
            gateway.openai(api_key="key-b").chat.completions.create(model=MODEL, messages=MESSAGES)
        assert wrong.value.code == "invalid_api_key"
        with gateway.http() as http:
            missing = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES})
        assert missing.status_code == 401 and "missing API key" in missing.json()["error"]["message"]
        raw = gateway.openai(api_key="key-a").chat.completions.with_raw_response.create(
            model=MODEL, messages=MESSAGES, max_tokens=2
        )
        accepted = gateway.events(raw.headers["x-request-id"])[0]
        assert isinstance(accepted, ev.RequestAccepted) and accepted.tenant == "tenant-a"


def test_no_byte_of_a_stream_goes_out_before_its_commit_point_is_durable(
    gateway: RunningGateway, database_url: str
) -> None:
    """The commit point's append runs while the response is made ready (app/api/generate.py),
    but its head and first events wait for it: with the log held (a transaction locks
    the events table), the client receives nothing, head included, until it lets go."""
    locker = gateway.call(asyncpg.connect(asyncpg_dsn(database_url)))
    try:
        gateway.call(locker.execute("BEGIN; LOCK TABLE request_events IN EXCLUSIVE MODE"))
        body = json.dumps({"model": MODEL, "messages": MESSAGES, "stream": True, "max_tokens": 6, "seed": 5})
        port = int(gateway.url.rsplit(":", 1)[1])
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        with sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer test-key\r\n"
                b"content-type: application/json\r\nconnection: close\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body.encode())
            )

            def committing() -> bool:  # the commit point recorded, its append waiting for the log
                return any(driver.state.phase is Phase.DECODE for driver in list(gateway.gateway.ctx.drivers.values()))

            deadline = time.monotonic() + 20
            while not committing():
                assert time.monotonic() < deadline, "the stream never reached its commit point"
                time.sleep(0.01)
            time.sleep(0.3)
            sock.setblocking(False)
            with pytest.raises(BlockingIOError):
                sock.recv(65536)  # not one byte while the commit point is not durable
            sock.setblocking(True)
            gateway.call(locker.execute("COMMIT"))
            received = b""
            while chunk := sock.recv(65536):
                received += chunk
    finally:
        gateway.call(locker.close())
    head, _, rest = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and b"text/event-stream" in head
    request_id = next(
        line.split(b":", 1)[1].strip() for line in head.split(b"\r\n") if line.startswith(b"x-request-id")
    )
    datas = [line[5:].strip() for line in rest.split(b"\n") if line.startswith(b"data:")]
    assert datas[-1] == b"[DONE]"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in map(json.loads, datas[:-1]) if c["choices"])
    events = gateway.events(request_id.decode())
    assert fold(events).outcome is Outcome.COMPLETED and delivered_text(events) == text and text
    order = names(events)
    assert order.index("FirstDeltaCommitted") < order.index("DeltasDelivered")
