"""Bodies that once passed the gateway and took its replicas down (docs/design.md §13), sent to a real
gateway over real sim workers: each is a 400 naming the param, nothing reaches a worker,
and no replica is any nearer ejection."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.support.gateway import MODEL, RunningGateway
from tests.support.workers import WorkerProcess

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}

BAD: list[tuple[str, dict[str, Any], str]] = [
    (
        "json_schema a string",
        {"response_format": {"type": "json_schema", "json_schema": "x"}},
        "response_format.json_schema",
    ),
    (
        "tool_choice name a list",
        {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": ["f"]}}},
        "tool_choice.function.name",
    ),
    (
        "parameters a string",
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
        "tools[0].function.parameters",
    ),
    (
        "properties a list",
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": ["a"]}}}]},
        "tools[0].function.parameters.properties",
    ),
    ("tools [1]", {"tools": [1]}, "tools[0]"),
    ("tool_choice function a string", {"tools": [TOOL], "tool_choice": {"function": "f"}}, "tool_choice.function"),
    ("role a list", {"messages": [{"role": ["user"], "content": "x"}]}, "messages[0].role"),
    ("role an object", {"messages": [{"role": {"r": "user"}, "content": "x"}]}, "messages[0].role"),
    (
        "a text part whose text is a number",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
        "messages[0].content",
    ),
]


def _attempts_on_workers(workers: list[WorkerProcess]) -> list[int]:
    return [len(httpx.get(w.base_url + "/admin/attempts", timeout=5).json()["attempts"]) for w in workers]


@pytest.mark.parametrize(("fields", "param"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_a_body_an_engine_would_fail_on_is_a_400_naming_the_param(
    gateway: RunningGateway, sim_pair: list[WorkerProcess], fields: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
    before = _attempts_on_workers(sim_pair)
    with gateway.http() as http:
        for stream in (False, True):
            response = http.post("/v1/chat/completions", json={**body, "stream": stream})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert (error["param"], error["code"], error["type"]) == (param, "invalid_request", "invalid_request_error")
            assert "Traceback" not in response.text
    assert _attempts_on_workers(sim_pair) == before  # nothing reached a worker
    for replica in gateway.gateway.ctx.pool.replicas.values():
        assert replica.consecutive_failures == 0 and gateway.gateway.ctx.pool.available(replica)


def test_after_every_bad_body_the_replicas_still_serve(gateway: RunningGateway) -> None:
    with gateway.http() as http:
        for _, fields, _ in BAD * 2:  # six were enough to eject both replicas before
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
            assert http.post("/v1/chat/completions", json=body).status_code == 400
    answer = gateway.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert answer.choices[0].message.content
    assert gateway.gateway.ctx.drivers == {}
