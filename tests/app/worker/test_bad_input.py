"""Every kind of bad input gets a clear JSON error with a stable code (and no stream)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from app.contract.json_depth import WORKER_MAX_JSON_DEPTH
from app.replicas.worker_client import WorkerClient, http_client
from app.replicas.worker_errors import RequestRefused
from statemachine.events import FailureKind
from tests.app.worker.engines import EngineUnderTest
from tests.support.workers import request_id


def _start_body(engine: EngineUnderTest, **changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "request_id": request_id(),
        "attempt": 1,
        "lease_epoch": 1,
        "lease_ttl_ms": 5000,
        "model": engine.model,
        "prompt": "hello",
        "params": {"max_tokens": 4},
    }
    for key, value in changes.items():
        if value is _DROP:
            body.pop(key)
        elif key == "params":
            body["params"] = {**body["params"], **value}
        else:
            body[key] = value
    return body


_DROP = object()
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}

# (case id, changes to a valid start body, status, code, field)
START_CASES: list[tuple[str, dict[str, Any], int, str, str | None]] = [
    ("no request_id", {"request_id": _DROP}, 400, "missing_field", "request_id"),
    ("no attempt", {"attempt": _DROP}, 400, "missing_field", "attempt"),
    ("no lease_epoch", {"lease_epoch": _DROP}, 400, "missing_field", "lease_epoch"),
    ("no lease_ttl_ms", {"lease_ttl_ms": _DROP}, 400, "missing_field", "lease_ttl_ms"),
    ("no model", {"model": _DROP}, 400, "missing_field", "model"),
    ("no prompt nor messages", {"prompt": _DROP}, 400, "missing_field", "messages"),
    ("prompt and messages", {"messages": [{"role": "user", "content": "x"}]}, 400, "invalid_field", "prompt"),
    ("prompt a number", {"prompt": 5}, 400, "invalid_field", "prompt"),
    ("prompt negative token ids", {"prompt": [1, -2]}, 400, "invalid_field", "prompt"),
    ("a batch with an empty prompt", {"prompt": ["a", ""]}, 400, "invalid_field", "prompt"),
    ("a batch of token ids and a number", {"prompt": [[1], [2, "x"]]}, 400, "invalid_field", "prompt"),
    ("attempt 0", {"attempt": 0}, 400, "invalid_field", "attempt"),
    ("attempt a string", {"attempt": "1"}, 400, "invalid_field", "attempt"),
    ("negative epoch", {"lease_epoch": -1}, 400, "invalid_field", "lease_epoch"),
    ("ttl too short", {"lease_ttl_ms": 10}, 400, "invalid_field", "lease_ttl_ms"),
    ("messages not a list", {"prompt": _DROP, "messages": "hi"}, 400, "invalid_field", "messages"),
    (
        "message without role",
        {"prompt": _DROP, "messages": [{"content": "x"}]},
        400,
        "invalid_field",
        "messages[0].role",
    ),
    ("unknown model", {"model": "no-such-model"}, 404, "unknown_model", "model"),
    ("unknown field", {"priority": 1}, 400, "unknown_field", "priority"),
    ("unknown param", {"params": {"logit_bias": {}}}, 400, "unknown_field", "params.logit_bias"),
    ("negative temperature", {"params": {"temperature": -0.5}}, 400, "invalid_field", "params.temperature"),
    ("top_p zero", {"params": {"top_p": 0}}, 400, "invalid_field", "params.top_p"),
    ("top_p above one", {"params": {"top_p": 1.5}}, 400, "invalid_field", "params.top_p"),
    ("max_tokens zero", {"params": {"max_tokens": 0}}, 400, "invalid_field", "params.max_tokens"),
    ("n zero", {"params": {"n": 0}}, 400, "invalid_field", "params.n"),
    ("n huge", {"params": {"n": 1000}}, 400, "invalid_field", "params.n"),
    ("seed a string", {"params": {"seed": "x"}}, 400, "invalid_field", "params.seed"),
    ("empty stop", {"params": {"stop": [""]}}, 400, "invalid_field", "params.stop"),
    (
        "tool without name",
        {"params": {"tools": [{"type": "function", "function": {}}]}},
        400,
        "invalid_field",
        "params.tools[0].function.name",
    ),
    (
        "tool_choice not a tool",
        {"params": {"tool_choice": {"type": "function", "function": {"name": "x"}}}},
        400,
        "invalid_field",
        "params.tool_choice.function.name",
    ),
    (
        "bad response_format",
        {"params": {"response_format": {"type": "xml"}}},
        400,
        "invalid_field",
        "params.response_format.type",
    ),
    # each of these was once a 500
    ("a tool that is a number", {"params": {"tools": [1]}}, 400, "invalid_field", "params.tools[0]"),
    (
        "tool_choice's function a string",
        {"params": {"tools": [TOOL], "tool_choice": {"function": "f"}}},
        400,
        "invalid_field",
        "params.tool_choice.function",
    ),
    (
        "tool_choice's name a list",
        {"params": {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": ["f"]}}}},
        400,
        "invalid_field",
        "params.tool_choice.function.name",
    ),
    (
        "a text part whose text is a number",
        {"prompt": _DROP, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        400,
        "invalid_field",
        "messages[0].content",
    ),
    (
        "json_schema a string",
        {"params": {"response_format": {"type": "json_schema", "json_schema": "x"}}},
        400,
        "invalid_field",
        "params.response_format.json_schema",
    ),
    (
        "a role that is a list",
        {"prompt": _DROP, "messages": [{"role": ["user"], "content": "x"}]},
        400,
        "invalid_field",
        "messages[0].role",
    ),
    ("a NUL in the request id", {"request_id": "a\x00b"}, 400, "invalid_field", "request_id"),
    ("a newline in the model", {"model": "sim\n"}, 400, "invalid_field", "model"),
]


@pytest.mark.parametrize(
    ("changes", "status", "code", "field"), [c[1:] for c in START_CASES], ids=[c[0] for c in START_CASES]
)
async def test_a_bad_start_is_refused(
    engine: EngineUnderTest, changes: dict[str, Any], status: int, code: str, field: str | None
):
    async with http_client() as http:
        response = await http.post(engine.worker.base_url + "/v1/attempts", json=_start_body(engine, **changes))
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["code"], error.get("field")) == (code, field)
    assert error["message"]


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b""], ids=["broken", "array", "empty"])
@pytest.mark.parametrize("path", ["/v1/attempts", "/v1/attempts/renew", "/v1/attempts/cancel"])
async def test_a_body_that_is_not_a_json_object_is_refused(engine: EngineUnderTest, path: str, raw: bytes):
    async with http_client() as http:
        response = await http.post(engine.worker.base_url + path, content=raw)
    assert (response.status_code, response.json()["error"]["code"]) == (400, "invalid_json")


@pytest.mark.parametrize(
    ("path", "body", "code", "field"),
    [
        (
            "/v1/attempts/renew",
            {"request_id": "r", "attempt": 1, "lease_epoch": 1},
            "missing_field",
            "lease_ttl_ms",
        ),
        (
            "/v1/attempts/renew",
            {"attempt": 1, "lease_epoch": 1, "lease_ttl_ms": 900},
            "missing_field",
            "request_id",
        ),
        (
            "/v1/attempts/renew",
            {"request_id": "r", "attempt": 1, "lease_epoch": 1, "lease_ttl_ms": 900, "renewal": 2},
            "missing_field",
            "answered",
        ),
        (
            "/v1/attempts/renew",
            {"request_id": "r", "attempt": 1, "lease_epoch": 1, "lease_ttl_ms": 900, "renewal": 2, "answered": 2},
            "invalid_field",
            "answered",
        ),
        (
            "/v1/attempts/renew",
            {"request_id": "r", "attempt": 1, "lease_epoch": 1, "lease_ttl_ms": 900, "answered": 0},
            "missing_field",
            "renewal",
        ),
        ("/v1/attempts/cancel", {"request_id": "r", "attempt": 1}, "missing_field", "lease_epoch"),
        (
            "/v1/attempts/cancel",
            {"request_id": "r", "attempt": 1, "lease_epoch": 1, "x": 1},
            "unknown_field",
            "x",
        ),
    ],
)
async def test_bad_renew_and_cancel_bodies(
    engine: EngineUnderTest, path: str, body: dict[str, Any], code: str, field: str
):
    async with http_client() as http:
        response = await http.post(engine.worker.base_url + path, json=body)
    assert response.status_code == 400
    assert (response.json()["error"]["code"], response.json()["error"]["field"]) == (code, field)


async def test_a_prompt_too_long_for_the_model_is_refused(engine: EngineUnderTest):
    client = WorkerClient(engine.worker.base_url)
    try:
        with pytest.raises(RequestRefused) as refused:
            await client.start(
                request_id=request_id(),
                attempt=1,
                lease_epoch=1,
                lease_ttl_s=5,
                model=engine.model,
                prompt=" ".join(["word"] * engine.max_prompt_words),
            )
    finally:
        await client.aclose()
    # vLLM's words and the code a client gets through an openai replica (app/contract/refusal_codes.py)
    assert (refused.value.status, refused.value.code) == (400, "context_length_exceeded")
    assert refused.value.message.startswith("This model's maximum context length is ")
    assert refused.value.param in ("input_tokens", "input_text")  # vLLM counts characters first
    assert refused.value.kind is FailureKind.REQUEST_REFUSED and refused.value.released


async def test_the_client_surfaces_the_code_and_field(engine: EngineUnderTest):
    client = WorkerClient(engine.worker.base_url)
    try:
        with pytest.raises(RequestRefused) as refused:
            await client.start(
                request_id=request_id(),
                attempt=1,
                lease_epoch=1,
                lease_ttl_s=5,
                model=engine.model,
                prompt="x",
                params={"temperature": -1},
            )
    finally:
        await client.aclose()
    assert (refused.value.code, refused.value.field) == ("invalid_field", "params.temperature")


# --- bodies that took the worker down or held its memory ----------------------------------


@pytest.mark.parametrize("depth", [WORKER_MAX_JSON_DEPTH + 1, 1100, 100_000])
@pytest.mark.parametrize("path", ["/v1/attempts", "/v1/leases/renew", "/admin/faults"])
async def test_json_nested_too_deep_is_refused(engine: EngineUnderTest, path: str, depth: int):
    raw = b'{"a": ' * depth + b"1" + b"}" * depth
    async with http_client() as http:
        response = await http.post(engine.worker.base_url + path, content=raw)
    assert (response.status_code, response.json()["error"]["code"]) == (400, "invalid_json")
    assert f"deeper than {WORKER_MAX_JSON_DEPTH}" in response.json()["error"]["message"]


async def test_a_deep_but_sane_tool_schema_is_served(engine: EngineUnderTest):
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(20):
        schema = {"type": "object", "properties": {"x": schema}}
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    async with http_client() as http:
        response = await http.post(
            engine.worker.base_url + "/v1/attempts",
            json=_start_body(engine, params={"tools": [tool], "tool_choice": "none"}),
        )
        assert response.status_code == 200, response.text
        assert b'"type": "done"' in response.content


_HEAD = b'"attempt": 1, "lease_epoch": 1, "lease_ttl_ms": 5000, "model": "sim"'


@pytest.mark.parametrize(
    "raw",
    [
        b'{"request_id": "\\ud800", ' + _HEAD + b', "prompt": "x"}',
        b'{"request_id": "r", ' + _HEAD + b', "prompt": "\\udfff"}',
        b'{"request_id": "r", ' + _HEAD + b', "prompt": "x", "params": {"temperature": NaN}}',
        b'{"request_id": "r", ' + _HEAD + b', "prompt": "x", "params": {"seed": ' + b"9" * 5000 + b"}}",
    ],
    ids=["lone surrogate id", "lone surrogate prompt", "NaN", "5,000 digits"],
)
async def test_json_no_writer_could_echo_is_refused_and_the_listing_still_answers(engine: EngineUnderTest, raw: bytes):
    async with http_client() as http:
        response = await http.post(engine.worker.base_url + "/v1/attempts", content=raw)
        assert (response.status_code, response.json()["error"]["code"]) == (400, "invalid_json"), response.text
        listing = await http.get(engine.worker.base_url + "/admin/attempts")
        assert listing.status_code == 200


async def test_a_body_over_the_limit_is_refused_without_reading_it(engine: EngineUnderTest):
    """A declared 50 MB body is refused at once (the worker reads none of it); a chunked
    one is refused once it passes the limit (8 MiB by default)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", engine.worker.port)
    try:
        writer.write(
            b"POST /v1/attempts HTTP/1.1\r\nhost: w\r\ncontent-type: application/json\r\n"
            b"content-length: 50000000\r\n\r\n"
        )
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 413"), head
    finally:
        writer.close()

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(9):
            yield b"x" * (1 << 20)
        yield b'"}'

    async with http_client() as http:
        response = await http.post(engine.worker.base_url + "/v1/attempts", content=chunks())
    assert (response.status_code, response.json()["error"]["code"]) == (413, "body_too_large")
