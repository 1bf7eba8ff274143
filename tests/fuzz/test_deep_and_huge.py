"""Two families on every route of the gateway and the worker: bodies nested around the one
nesting limit (app/contract/json_depth.py), and integers of up to 10,000 digits wherever a
client writes one (a body field, a query parameter, a header, a path segment;
app/contract/integers.py). The properties are test_gateway.py's and test_worker.py's: no
5xx, a refusal an error with a stable code, a refused request leaves the log as it was, no
traceback in either server's log."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.contract import json_depth as deep_json
from app.contract.json_depth import MAX_JSON_DEPTH, WORKER_MAX_JSON_DEPTH
from tests.fuzz import test_gateway as gateway_family
from tests.fuzz import test_worker as worker_family
from tests.fuzz.conftest import ADMIN_TOKEN, API_KEY, MODEL, Stack, Tally, fuzz_settings

# each a minute or more: side by side; untraced: the gateway and worker are processes of their own,
# measured there (tests/conftest.py)
pytestmark = [pytest.mark.slow, pytest.mark.own_unit, pytest.mark.untraced]

KEY = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
DEPTHS = st.sampled_from(
    [
        2,
        64,
        65,
        255,
        256,
        MAX_JSON_DEPTH - 1,
        MAX_JSON_DEPTH,
        MAX_JSON_DEPTH + 1,
        WORKER_MAX_JSON_DEPTH + 1,
        1024,
        1025,
        5000,
    ]
)
DIGITS = st.sampled_from([1, 10, 19, 20, 39, 309, 4300, 4301, 5000, 10_000])
BODY_ROUTES = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/embeddings",
    "/score",
    "/tokenize",
    "/detokenize",
]
VALID: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 2},
    "/v1/responses": {"model": MODEL, "input": "hi", "max_output_tokens": 16},
    "/v1/messages": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/messages/count_tokens": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/embeddings": {"model": MODEL, "input": "hi"},
    "/score": {"model": MODEL, "queries": "hi", "documents": ["there"]},
    "/tokenize": {"model": MODEL, "prompt": "hi"},
    "/detokenize": {"model": MODEL, "tokens": [1, 2]},
}
POOLED = ("/v1/embeddings", "/score")
INTEGER_FIELDS = ["max_tokens", "max_output_tokens", "seed", "n", "top_k", "logprobs", "top_logprobs", "min_tokens"]


@st.composite
def nesting(draw: st.DrawFn, depth: int) -> Any:
    """``depth`` levels of arrays and objects, mixed, around a scalar."""
    kinds = draw(st.lists(st.booleans(), min_size=depth, max_size=depth))
    value: Any = draw(st.sampled_from([0, "x", None, []]))
    for is_list in kinds:
        value = [value] if is_list else {"k": value}
    return value


@st.composite
def deep_body(draw: st.DrawFn, valid: dict[str, Any]) -> bytes:
    """``valid`` with its nesting placed in a field (known or not), or nesting for the whole body."""
    depth = draw(DEPTHS)
    where = draw(st.sampled_from(["whole", "unknown", "known", "tools", "message"]))
    body: Any = dict(valid)
    if where == "whole":
        body = draw(nesting(depth))
    elif where == "unknown":
        body["x_unread"] = draw(nesting(depth - 1))
    elif where == "known":
        body[draw(st.sampled_from(sorted(valid) or ["model"]))] = draw(nesting(depth - 1))
    elif where == "tools":
        schema = {"type": "object", "properties": {}, "x": draw(nesting(max(depth - 6, 0)))}
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    else:
        body["messages"] = [{"role": "user", "content": draw(nesting(max(depth - 3, 0)))}]
    return deep_json.dumps(body).encode()


def huge(digits: int, sign: str = "") -> str:
    return sign + "9" * digits


@st.composite
def huge_integer_body(draw: st.DrawFn, valid: dict[str, Any]) -> bytes:
    body = dict(valid)
    text = deep_json.dumps(body)
    field = draw(st.sampled_from(INTEGER_FIELDS))
    number = huge(draw(DIGITS), draw(st.sampled_from(["", "-"])))
    return (text[:-1] + f', "{field}": {number}}}').encode()


def sim_has_no_tokenizer(tally: Tally, family: str, response: httpx.Response) -> bool:
    """The sim worker's 501 to a tokenizer route (by design: docs/worker-protocol.md), counted."""
    if response.status_code == 501 and "no tokenizer" in response.text and "tokenize" in response.request.url.path:
        tally.record(family, 501)
        return True
    return False


def test_deep_bodies_on_every_gateway_route(stack: Stack, tally: Tally) -> None:
    with stack.gateway_client() as http:

        @fuzz_settings()
        @given(data=st.data(), route=st.sampled_from([*BODY_ROUTES, "/v1/requests/req_x/cancel"]))
        def property_(data: st.DataObject, route: str) -> None:
            body = data.draw(deep_body(VALID.get(route, {})))
            response = http.post(route, content=body, headers=KEY)
            if not sim_has_no_tokenizer(tally, "gateway.deep", response):
                generation = route.startswith("/v1/c") or route in POOLED  # a 2xx: an accepted request
                gateway_family.judge(stack, tally, "gateway.deep", response, generation=generation)

        gateway_family.run_family(stack, tally, property_)


def test_huge_integers_on_every_gateway_route(stack: Stack, tally: Tally) -> None:
    with stack.gateway_client() as http:
        http.post("/v1/chat/completions", json={**VALID["/v1/chat/completions"], "stream": True}, headers=KEY)
        created = http.post("/v1/responses", json=VALID["/v1/responses"], headers=KEY)
        request_id, response_id = created.headers["x-request-id"], created.json()["id"]
        tally.accepted.add(request_id)  # a refusal about it names it: not a request of its own

        @fuzz_settings()
        @given(
            digits=DIGITS,
            sign=st.sampled_from(["", "-", "+"]),
            place=st.sampled_from(["body", "query", "header", "path"]),
            data=st.data(),
        )
        def property_(digits: int, sign: str, place: str, data: st.DataObject) -> None:
            number = huge(digits, sign)
            if place == "body":
                route = data.draw(st.sampled_from(BODY_ROUTES))
                response = http.post(route, content=data.draw(huge_integer_body(VALID[route])), headers=KEY)
            elif place == "query":
                target = data.draw(
                    st.sampled_from(
                        [
                            f"/v1/requests/{request_id}/stream?after={{}}",
                            f"/v1/responses/{response_id}?stream=true&starting_after={{}}",
                            f"/v1/responses/{response_id}/input_items?limit={{}}",
                            f"/v1/requests/{request_id}/events?after_seq={{}}",
                            f"/v1/requests/{request_id}/events?limit={{}}",
                            "/ui/requests?limit={}",
                        ]
                    )
                )
                response = http.get(
                    target.format(number), headers=ADMIN if "/events" in target or "/ui/" in target else KEY
                )
            elif place == "header":
                # (a Content-Length of any size is the HTTP layer's 400 before any route: h11 will not send one)
                response = http.get(f"/v1/requests/{request_id}/stream", headers={**KEY, "last-event-id": number})
            else:
                target = data.draw(st.sampled_from(["/v1/requests/{}", "/v1/responses/{}", "/ui/requests/{}"]))
                response = http.get(target.format(number), headers=KEY if target == "/v1/responses/{}" else ADMIN)
            if not sim_has_no_tokenizer(tally, "gateway.huge_integers", response):
                gateway_family.judge(stack, tally, "gateway.huge_integers", response, generation=place == "body")

        gateway_family.run_family(stack, tally, property_)


def test_deep_and_huge_on_every_worker_route(stack: Stack, tally: Tally) -> None:
    routes = [
        "/v1/attempts",
        "/v1/attempts/renew",
        "/v1/leases/renew",
        "/v1/attempts/cancel",
        "/admin/faults",
        "/v1/tokenize",
        "/v1/detokenize",
    ]
    with stack.worker_client() as http:

        @fuzz_settings()
        @given(data=st.data(), route=st.sampled_from([*routes, "/admin/faults/{}/release"]))
        def property_(data: st.DataObject, route: str) -> None:
            if data.draw(st.booleans()):
                body = data.draw(deep_body({"request_id": "fuzz-deep", "attempt": 1}))
                family = "worker.deep"
            else:
                body = data.draw(huge_integer_body({"request_id": "fuzz-huge", "attempt": 1}))
                family = "worker.huge_integers"
            target = route.format(huge(data.draw(DIGITS)))
            call = lambda: http.post(target, content=body, headers=worker_family.TOKEN)  # noqa: E731
            response = worker_family.unchanged_when_refused(stack, http, call)
            if not sim_has_no_tokenizer(tally, family, response):
                worker_family.judge(tally, family, response)
            for attempt in worker_family.attempts(http):  # an admitted start still running: cancel it
                ref = {k: attempt[k] for k in ("request_id", "attempt", "lease_epoch")}
                http.post("/v1/attempts/cancel", json=ref, headers=worker_family.TOKEN)

        worker_family.run_family(stack, property_)
