"""Hypothesis against a running ``phasegate serve`` (real PostgreSQL, a real sim worker).

Families: chat and completion bodies (near-valid and not JSON at all, under any
content type and key), header sets, paths and query strings under any method, the admin
and audit routes, resume and cancel. For every case:

- no 5xx, and a refusal is an OpenAI-style error with a stable code;
- a refused request leaves nothing in the log: no event under its ``x-request-id``, and,
  per family, the log's events and ``requests`` rows apart from those of accepted requests
  are as many after as before;
- and at the end of each family, neither server wrote a traceback.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.contract.messages import NOT_SERVED as MESSAGES_NOT_SERVED
from app.contract.messages import CountTokensRequest, MessagesRequest
from app.contract.request_fields import OWN, RECORDED
from app.contract.requests import PASSED_CHAT, PASSED_COMPLETIONS
from tests.fuzz import strategies as s
from tests.fuzz.conftest import ADMIN_TOKEN, API_KEY, MODEL, Stack, Tally, fuzz_settings

# untraced: the gateway and worker are processes of their own, measured there (tests/conftest.py)
pytestmark = [pytest.mark.slow, pytest.mark.untraced]

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
MESSAGE = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COUNT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
MESSAGE_FIELDS = sorted(
    {*MessagesRequest.model_fields, "temperature", "top_p", "top_k", "stream", *MESSAGES_NOT_SERVED}
)
KEY = {"authorization": f"Bearer {API_KEY}"}
AUTH = st.one_of(
    st.just(KEY),
    st.just({}),
    st.just({"authorization": f"Bearer {ADMIN_TOKEN}"}),
    st.builds(lambda value: {"authorization": value}, s.HEADER_VALUE),
)
CONTENT_TYPES = st.one_of(
    st.just(b"application/json"),
    st.sampled_from([b"application/json; charset=utf-8", b"text/plain", b"", b"application/x-www-form-urlencoded"]),
    s.HEADER_VALUE,
)


def judge(stack: Stack, tally: Tally, family: str, response: httpx.Response, *, generation: bool = False) -> None:
    """The properties of one case (the module's docstring); ``generation``: a 2xx is an accepted request."""
    status = response.status_code
    tally.record(family, status)
    # count_tokens asks the replica's tokenizer: the sim has none and says so (501), as on /tokenize
    relayed = family.endswith("count_tokens") and status == 501 and "no tokenizer" in response.text
    assert status < 500 or relayed, f"{family}: {status} {response.text[:500]}\n{stack.gateway.logs()[-3000:]}"
    request_id = response.headers.get("x-request-id")
    if generation and status < 300 and request_id:
        tally.accepted.add(request_id)
    elif status >= 400 and request_id and request_id not in tally.accepted:
        assert stack.events_of(request_id) == 0, f"{family}: refused {request_id} ({status}) is in the log"
    if status >= 400 and response.request.method != "HEAD" and response.request.url.path.startswith("/v1/"):
        error = response.json()["error"]
        assert isinstance(error["code"], str) and error["code"] and isinstance(error["message"], str), error


def run_family(stack: Stack, tally: Tally, property_: Callable[[], None]) -> None:
    """Run ``property_`` (a Hypothesis test); the log apart from accepted requests must not move."""
    before = stack.log_apart_from(set(tally.accepted))
    property_()
    assert stack.log_apart_from(tally.accepted) == before, "refused requests changed the log"
    assert stack.server_faults() == []


@pytest.mark.parametrize(
    ("path", "valid", "fields"),
    [
        ("/v1/chat/completions", CHAT, sorted(PASSED_CHAT | RECORDED | set(OWN))),
        ("/v1/completions", COMPLETION, sorted(PASSED_COMPLETIONS | RECORDED | set(OWN))),
        ("/v1/messages", MESSAGE, MESSAGE_FIELDS),
        ("/v1/messages/count_tokens", COUNT, sorted(CountTokensRequest.model_fields)),
    ],
    ids=["chat", "completions", "messages", "count_tokens"],
)
def test_generation_bodies(stack: Stack, tally: Tally, path: str, valid: dict[str, Any], fields: list[str]) -> None:
    family = {"/v1/chat/completions": "gateway.chat", "/v1/completions": "gateway.completions"}.get(
        path, "gateway." + path.removeprefix("/v1/").replace("/", ".")
    )
    body = st.one_of(s.mutated(valid, fields, s.SHAPED).map(s.encode), s.JSON.map(s.encode), s.NOT_JSON)

    with stack.gateway_client() as http:

        @fuzz_settings()
        @given(body=body, key=st.one_of(st.none(), s.HEADER_VALUE.filter(bool)))
        def property_(body: bytes, key: bytes | None) -> None:
            headers: dict[str, Any] = {"content-type": "application/json", **KEY}
            if key is not None:
                headers["idempotency-key"] = key
            judge(stack, tally, family, http.post(path, content=body, headers=headers), generation=True)

        run_family(stack, tally, property_)


def test_keys_and_content_types(stack: Stack, tally: Tally) -> None:
    """A valid body under any key and content type."""
    with stack.gateway_client() as http:

        @fuzz_settings()
        @given(
            content_type=CONTENT_TYPES,
            auth=st.one_of(AUTH, st.builds(lambda value: {"x-api-key": value}, s.HEADER_VALUE)),
            route=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/messages"]),
        )
        def property_(content_type: bytes, auth: dict[str, Any], route: str) -> None:
            body = s.encode({"/v1/chat/completions": CHAT, "/v1/completions": COMPLETION}.get(route, MESSAGE))
            response = http.post(route, content=body, headers={"content-type": content_type, **auth})
            judge(stack, tally, "gateway.auth", response, generation=True)

        run_family(stack, tally, property_)


def test_headers(stack: Stack, tally: Tally) -> None:
    with stack.gateway_client() as http:

        @fuzz_settings()
        @given(headers=s.HEADERS, route=st.sampled_from(["chat", "models", "audit"]))
        def property_(headers: dict[str, bytes], route: str) -> None:
            sent = {**KEY, "content-type": "application/json", **headers}
            if route == "chat":
                response = http.post("/v1/chat/completions", content=s.encode(CHAT), headers=sent)
            elif route == "models":
                response = http.get("/v1/models", headers=sent)
            else:
                response = http.get("/v1/requests/req_unknown/events", headers=sent)
            judge(stack, tally, "gateway.headers", response, generation=route == "chat")

        run_family(stack, tally, property_)


def test_paths_and_queries(stack: Stack, tally: Tally) -> None:
    prefixes = st.sampled_from(["/v1/", "/v1/requests/", "/ui/requests/", "/admin/", "/", "//", "/v1/chat/"])
    with stack.gateway_client() as http:

        @fuzz_settings()
        @given(
            method=s.METHODS,
            prefix=prefixes,
            segments=st.lists(s.SEGMENT, max_size=3),
            query=s.QUERY,
            auth=AUTH,
        )
        def property_(method: str, prefix: str, segments: list[str], query: str, auth: dict[str, Any]) -> None:
            target = (prefix + "/".join(segments) + (f"?{query}" if query else "")).encode("ascii")
            url = httpx.URL(stack.gateway.url).copy_with(raw_path=target)
            response = http.request(method, url, headers=auth, content=b"{}" if method != "GET" else None)
            judge(stack, tally, "gateway.paths", response)

        run_family(stack, tally, property_)


def _ids(tally: Tally) -> st.SearchStrategy[str]:
    """Request ids: a real (accepted) one or generated text, percent-encoded."""
    real = st.sampled_from(sorted(tally.accepted)) if tally.accepted else st.just("req_none")
    return st.one_of(real, s.SEGMENT)


def test_admin_and_audit_routes(stack: Stack, tally: Tally) -> None:
    with stack.gateway_client() as http:
        http.post("/v1/chat/completions", json=CHAT, headers=KEY)  # at least one request to read

        @fuzz_settings()
        @given(
            request_id=_ids(tally),
            route=st.sampled_from(["/v1/requests/{}", "/v1/requests/{}/events", "/ui/requests/{}", "/ui/requests"]),
            query=s.QUERY,
            auth=AUTH,
        )
        def property_(request_id: str, route: str, query: str, auth: dict[str, Any]) -> None:
            target = route.format(request_id) + (f"?{query}" if query else "")
            url = httpx.URL(stack.gateway.url).copy_with(raw_path=target.encode("ascii"))
            judge(stack, tally, "gateway.admin", http.get(url, headers=auth))

        run_family(stack, tally, property_)


def test_resume_and_cancel(stack: Stack, tally: Tally) -> None:
    with stack.gateway_client() as http:
        http.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=KEY)

        @fuzz_settings()
        @given(
            request_id=_ids(tally),
            cancel=st.booleans(),
            last_event_id=st.one_of(st.none(), s.HEADER_VALUE, st.integers(-5, 10**30).map(lambda n: str(n).encode())),
            body=st.one_of(s.NOT_JSON, s.JSON.map(s.encode)),
            auth=AUTH,
        )
        def property_(
            request_id: str, cancel: bool, last_event_id: bytes | None, body: bytes, auth: dict[str, Any]
        ) -> None:
            headers = dict(auth)
            if cancel:
                url = httpx.URL(stack.gateway.url).copy_with(raw_path=f"/v1/requests/{request_id}/cancel".encode())
                response = http.post(url, content=body, headers={**headers, "content-type": "application/json"})
                judge(stack, tally, "gateway.cancel", response)
            else:
                if last_event_id is not None:
                    headers["last-event-id"] = last_event_id
                url = httpx.URL(stack.gateway.url).copy_with(raw_path=f"/v1/requests/{request_id}/stream".encode())
                judge(stack, tally, "gateway.resume", http.get(url, headers=headers))

        run_family(stack, tally, property_)
