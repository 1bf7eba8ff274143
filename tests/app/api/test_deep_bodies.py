"""Nesting: one limit where the body is parsed, the same on every route and replica kind
(app/contract/json_depth.py). A body at the limit is served as ``vllm serve`` serves it,
whatever field holds the nesting; one level deeper is a 400 naming the limit; never a 500.
Real gateways over real sim workers and a real OpenAI-kind upstream."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from app.config import ReplicaConfig
from app.contract import json_depth as deep_json
from app.contract.json_depth import MAX_JSON_DEPTH, depth_over
from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.scripted_upstream import ScriptedUpstream, running_scripted_upstream


def nested(levels: int) -> Any:
    """``levels`` arrays in one another (a list's depth is its levels)."""
    value: list[Any] = []
    for _ in range(levels - 1):
        value = [value]
    return value


def post(http: httpx.Client, path: str, body: Any) -> httpx.Response:
    """``body`` posted as JSON, written by the encoder that writes any depth (httpx's stops short)."""
    return http.post(path, content=deep_json.dumps(body), headers={"content-type": "application/json"})


def bodies(depth: int) -> list[tuple[str, str, dict[str, Any]]]:
    """A body of ``depth`` levels on each route that takes one; the nesting sits in a field
    passed on unread (the body object is level 1, the field's value level 2 onwards)."""
    deep = nested(depth - 1)
    schema = {"type": "object", "properties": {}, "x_deep": nested(depth - 4)}  # body, tools, tool, parameters
    deep_tool = {"type": "function", "name": "f", "parameters": schema}
    response = {"model": MODEL, "input": "hi", "max_output_tokens": 16, "tools": [deep_tool]}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    return [
        ("chat", "/v1/chat/completions", {**chat, "x_unread": deep}),
        ("chat stream", "/v1/chat/completions", {**chat, "stream": True, "x_unread": deep}),
        ("completions", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3, "x_unread": deep}),
        # the Responses API refuses unknown fields: its nesting sits in a function's schema
        ("responses", "/v1/responses", response),
        ("responses stream", "/v1/responses", {**response, "stream": True}),
        ("tokenize", "/tokenize", {"model": MODEL, "prompt": "hi", "x_unread": deep}),
    ]


def test_the_limit_counts_containers() -> None:
    assert not depth_over(nested(MAX_JSON_DEPTH), MAX_JSON_DEPTH)
    assert depth_over(nested(MAX_JSON_DEPTH + 1), MAX_JSON_DEPTH)
    assert not depth_over({"a": 1}, 1) and depth_over({"a": [1]}, 1)


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 1100])
def test_deeper_than_the_limit_is_a_400_naming_it_on_every_route(gateway: RunningGateway, depth: int) -> None:
    with gateway.http() as http:
        for name, path, body in bodies(depth):
            response = post(http, path, body)
            assert response.status_code == 400, (name, response.status_code, response.text[:300])
            error = response.json()["error"]
            assert error["code"] == "invalid_json" and f"deeper than {MAX_JSON_DEPTH} levels" in error["message"]


def test_a_body_at_the_limit_is_served_on_every_route_by_workers(gateway: RunningGateway) -> None:
    """As a shallow body is: the sim worker has no tokenizer, so ``/tokenize`` is its 501 either way."""
    with gateway.http() as http:
        for (name, path, body), (_, _, shallow) in zip(bodies(MAX_JSON_DEPTH), bodies(4), strict=True):
            expected = post(http, path, shallow).status_code
            assert expected == (501 if name == "tokenize" else 200)
            response = post(http, path, body)
            assert response.status_code == expected, (name, response.status_code, response.text[:300])
            assert "Traceback" not in response.text


def test_a_deep_tool_schema_at_the_limit_reaches_the_worker_and_is_answered(gateway: RunningGateway) -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "array", "items": {}}},
        "x_deep": nested(MAX_JSON_DEPTH - 5),
    }
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "tools": [tool]}
    assert not depth_over(body, MAX_JSON_DEPTH) and depth_over(body, MAX_JSON_DEPTH - 1)
    with gateway.http() as http:
        response = post(http, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text[:300]


@pytest.fixture
def upstream_gateway(database_url: str) -> Iterator[tuple[RunningGateway, ScriptedUpstream]]:
    with running_scripted_upstream() as upstream:
        upstream.script()
        replicas = [ReplicaConfig(id="u1", url=upstream.base_url, kind="openai")]
        with running_gateway(database_url, replicas=replicas) as running:
            yield running, upstream


def test_a_body_at_the_limit_reaches_an_openai_replica_whole(
    upstream_gateway: tuple[RunningGateway, ScriptedUpstream],
) -> None:
    gateway, _ = upstream_gateway
    _, path, body = bodies(MAX_JSON_DEPTH)[0]
    with httpx.Client(base_url=gateway.url, timeout=60) as http:
        response = post(http, path, body)
    assert response.status_code == 200, response.text[:300]


def test_a_deep_value_where_a_name_belongs_is_a_400_not_a_failure_to_quote_it(gateway: RunningGateway) -> None:
    """A refusal quotes what it refuses: a value nested to the limit is not written into it."""
    with gateway.http() as http:
        for path in ("/tokenize", "/detokenize", "/v1/chat/completions", "/v1/completions", "/v1/responses"):
            response = post(http, path, {"model": nested(MAX_JSON_DEPTH - 1), "prompt": "hi", "input": "hi"})
            assert response.status_code == 400, (path, response.status_code, response.text[:300])
            assert response.json()["error"]["code"] and len(response.text) < 2000  # nothing of it quoted whole
