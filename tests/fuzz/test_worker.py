"""Hypothesis against a running ``phasegate worker`` (sim engine) that requires its token.

Families: start bodies, renew and batched renew, cancel, the admin endpoints, any key on any
endpoint, and paths and queries under any method. For every case: no 5xx, a refusal is
``{"error": {"code", "message"}}``, and a refused call changes nothing: the worker's table of
attempts (its only state; the worker keeps no log) is the same after it. An admitted start
is read to its end, then cancelled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz import strategies as s
from tests.fuzz.conftest import MODEL, WORKER_TOKEN, Stack, Tally, fuzz_settings

# untraced: the gateway and worker are processes of their own, measured there (tests/conftest.py)
pytestmark = [pytest.mark.slow, pytest.mark.untraced]

TOKEN = {"authorization": f"Bearer {WORKER_TOKEN}"}
START_FIELDS = ["request_id", "attempt", "lease_epoch", "lease_ttl_ms", "model", "messages", "prompt", "params"]
START_FIELDS += ["heartbeat_ms"]
PARAM_FIELDS = ["max_tokens", "temperature", "top_p", "n", "seed", "stop", "tools", "tool_choice", "response_format"]


def start_body(request_id: str) -> dict[str, Any]:
    return {
        "request_id": request_id,
        "attempt": 1,
        "lease_epoch": 1,
        "lease_ttl_ms": 2000,
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "params": {"max_tokens": 2},
    }


def attempts(http: httpx.Client) -> list[dict[str, Any]]:
    listed: list[dict[str, Any]] = http.get("/admin/attempts", headers=TOKEN).json()["attempts"]
    return listed


def judge(tally: Tally, family: str, response: httpx.Response) -> None:
    status = response.status_code
    tally.record(family, status)
    assert status < 500, f"{family}: {status} {response.text[:500]}"
    if status >= 400 and response.request.method != "HEAD":
        error = response.json()["error"]
        assert isinstance(error["code"], str) and error["code"] and isinstance(error["message"], str), error


def unchanged_when_refused(stack: Stack, http: httpx.Client, call: Callable[[], httpx.Response]) -> httpx.Response:
    """``call``; when it is refused, the worker's attempts are as before (ages and leases aside)."""
    before = {(a["request_id"], a["attempt"]) for a in attempts(http)}
    response = call()
    if response.status_code >= 400:
        settled = {(a["request_id"], a["attempt"]) for a in attempts(http)}
        assert settled <= before, f"a refused call left attempts: {settled - before}"
    return response


def run_family(stack: Stack, property_: Callable[[], None]) -> None:
    property_()
    assert stack.server_faults() == []


def test_start_bodies(stack: Stack, tally: Tally) -> None:
    nested = dict(s.SHAPED) | {
        "params": st.one_of(s.mutated({"max_tokens": 2}, PARAM_FIELDS, s.SHAPED), s.JSON),
        "lease_ttl_ms": s.INTEGERS,
        "attempt": s.INTEGERS,
        "lease_epoch": s.INTEGERS,
        "request_id": s.TEXT,
    }
    numbers = iter(range(10**9))
    with stack.worker_client() as http:

        @fuzz_settings()
        @given(body=st.one_of(s.mutated(start_body("x"), START_FIELDS, nested).map(s.encode), s.NOT_JSON))
        def property_(body: bytes) -> None:
            # every start its own request id, unless the body's mutation chose one
            body = body.replace(b'"request_id": "x"', f'"request_id": "fuzz-{next(numbers)}"'.encode())
            with http.stream("POST", "/v1/attempts", content=body, headers=TOKEN) as response:
                frames = response.read()
            judge(tally, "worker.start", response)
            if response.status_code == 200:
                assert frames.rstrip().endswith(b"}"), frames[-200:]  # NDJSON to its last frame
            # an admitted start that is still running (a large max_tokens): cancel it
            for attempt in attempts(http):
                ref = {k: attempt[k] for k in ("request_id", "attempt", "lease_epoch")}
                http.post("/v1/attempts/cancel", json=ref, headers=TOKEN)

        run_family(stack, property_)


@pytest.mark.parametrize("route", ["/v1/attempts/renew", "/v1/leases/renew", "/v1/attempts/cancel"])
def test_lease_calls(stack: Stack, tally: Tally, route: str) -> None:
    ref = {"request_id": "fuzz-ref", "attempt": 1, "lease_epoch": 1, "lease_ttl_ms": 1000}
    fields = ["request_id", "attempt", "lease_epoch", "lease_ttl_ms", "leases"]
    nested = {"leases": st.lists(s.mutated(ref, fields, {}), max_size=3), "lease_ttl_ms": s.INTEGERS}
    valid = {"leases": [ref]} if route == "/v1/leases/renew" else ref
    if route == "/v1/attempts/cancel":  # a cancel names no lease time
        valid = {k: v for k, v in ref.items() if k != "lease_ttl_ms"}
    family = {"/v1/attempts/renew": "worker.renew", "/v1/leases/renew": "worker.renew_many"}.get(route, "worker.cancel")
    with stack.worker_client() as http:

        @fuzz_settings()
        @given(body=st.one_of(s.mutated(valid, fields, nested).map(s.encode), s.NOT_JSON))
        def property_(body: bytes) -> None:
            def call() -> httpx.Response:
                return http.post(route, content=body, headers=TOKEN)

            judge(tally, family, unchanged_when_refused(stack, http, call))

        run_family(stack, property_)


def test_keys_on_every_endpoint(stack: Stack, tally: Tally) -> None:
    """Without the right token every protocol call is 401 and changes nothing."""
    routes = [
        ("POST", "/v1/attempts"),
        ("POST", "/v1/attempts/renew"),
        ("POST", "/v1/leases/renew"),
        ("POST", "/v1/attempts/cancel"),
        ("GET", "/admin/attempts"),
        ("GET", "/admin/faults"),
    ]
    wrong = st.one_of(
        st.just({}),
        st.builds(lambda value: {"authorization": value}, s.HEADER_VALUE),
        st.just({"authorization": f"Bearer {WORKER_TOKEN}x"}),
        st.just({"authorization": f"bearer {WORKER_TOKEN[:-1]}"}),
    )
    with stack.worker_client() as http:

        @fuzz_settings()
        @given(route=st.sampled_from(routes), auth=wrong)
        def property_(route: tuple[str, str], auth: dict[str, Any]) -> None:
            method, path = route
            body = s.encode(start_body("fuzz-unauthorized")) if method == "POST" else None
            response = unchanged_when_refused(
                stack, http, lambda: http.request(method, path, content=body, headers=auth)
            )
            judge(tally, "worker.auth", response)
            assert response.status_code == 401

        run_family(stack, property_)


def test_paths_and_queries(stack: Stack, tally: Tally) -> None:
    prefixes = st.sampled_from(["/v1/", "/v1/attempts/", "/admin/", "/", "//", "/v1/leases/"])
    with stack.worker_client() as http:

        @fuzz_settings()
        @given(
            method=s.METHODS,
            prefix=prefixes,
            segments=st.lists(s.SEGMENT, max_size=3),
            query=s.QUERY,
            token=st.booleans(),
        )
        def property_(method: str, prefix: str, segments: list[str], query: str, token: bool) -> None:
            target = (prefix + "/".join(segments) + (f"?{query}" if query else "")).encode("ascii")
            url = httpx.URL(stack.worker.base_url).copy_with(raw_path=target)
            headers = TOKEN if token else {}

            def call() -> httpx.Response:
                return http.request(method, url, headers=headers, content=b"{}" if method != "GET" else None)

            judge(tally, "worker.paths", unchanged_when_refused(stack, http, call))

        run_family(stack, property_)


def test_probes_reveal_no_request_ids(stack: Stack, tally: Tally) -> None:
    """Health, readiness and metrics stay open to any caller, and name no request: the start
    family's attempts (ids ``fuzz-…``) appear in none of them."""
    with stack.worker_client() as http:
        started = http.post("/v1/attempts", json=start_body("fuzz-probed"), headers=TOKEN)
        assert started.status_code == 200

        @fuzz_settings()
        @given(
            path=st.sampled_from(["/v1/health", "/v1/ready", "/metrics"]),
            headers=s.HEADERS,
            query=s.QUERY,
        )
        def property_(path: str, headers: dict[str, bytes], query: str) -> None:
            url = httpx.URL(stack.worker.base_url).copy_with(raw_path=(path + (f"?{query}" if query else "")).encode())
            response = http.get(url, headers=headers)
            judge(tally, "worker.probes", response)
            too_large = sum(len(name) + len(value) for name, value in headers.items()) > 16384 - 1024
            assert response.status_code == 200 or (too_large and response.status_code == 431), response.text[:300]
            assert "fuzz-" not in response.text, response.text[:300]

        run_family(stack, property_)
