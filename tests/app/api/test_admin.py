"""The admin endpoints over real HTTP: a real gateway on a real log, and its admin token."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.incident.trace_io import import_trace
from statemachine.jsonform import to_json
from statemachine.trace import parse_trace
from tests.conftest import run_sync
from tests.support.gateway import RunningGateway, running_gateway

TRACES = Path(__file__).resolve().parents[2] / "traces"
TOKEN = "s3cret-admin"
ADMIN = {"authorization": f"Bearer {TOKEN}"}


def load(database_url: str, *names: str) -> None:
    for name in names:
        path = TRACES / f"{name}.jsonl"
        trace = parse_trace(path.read_text().splitlines())
        run_sync(lambda trace=trace, path=path: import_trace(database_url, trace, name=str(path)))


@pytest.fixture
def gateway(database_url: str) -> Iterator[RunningGateway]:
    load(database_url, "retry_before_first_delta", "fence_released_by_lease_expiry", "decode_interrupted")
    with running_gateway(database_url, [], admin_token=TOKEN) as running:
        yield running


def test_a_request_summary_comes_from_the_read_models(gateway: RunningGateway) -> None:
    with gateway.http(headers=ADMIN) as http:
        response = http.get("/v1/requests/req_retried")
    assert response.status_code == 200
    assert response.headers["x-request-id"].startswith("req_")
    body = response.json()
    assert body["object"] == "request" and body["id"] == "req_retried"
    request = body["request"]
    assert request["outcome"] == "completed" and request["attempts"] == 2
    assert request["replicas_tried"] == ["w1", "w2"] and request["first_delta_attempt"] == 2
    assert request["accepted_at"] == "2026-11-30T12:00:00.001000+00:00"
    assert [(a["attempt"], a["replica_id"], a["ended"]) for a in body["attempts"]] == [
        (1, "w1", "replica_exited"),
        (2, "w2", "completed"),
    ]


def test_events_come_a_page_at_a_time(gateway: RunningGateway) -> None:
    expected = [
        to_json(e)
        for e in parse_trace((TRACES / "fence_released_by_lease_expiry.jsonl").read_text().splitlines()).events
    ]
    got: list[dict[str, object]] = []
    after = 0
    pages = 0
    with gateway.http(headers=ADMIN) as http:
        while True:
            page = http.get("/v1/requests/req_fenced/events", params={"after_seq": after, "limit": 4}).json()
            assert page["object"] == "list" and len(page["data"]) <= 4
            got += page["data"]
            pages += 1
            if not page["has_more"]:
                assert page["next_after_seq"] is None
                break
            after = page["next_after_seq"]
            assert after == page["data"][-1]["seq"]
        assert got == expected and pages == 4  # 15 events: 4 + 4 + 4 + 3
        everything = http.get("/v1/requests/req_fenced/events").json()
        assert everything["data"] == expected and everything["has_more"] is False
        beyond = http.get("/v1/requests/req_fenced/events", params={"after_seq": 99}).json()
        assert beyond == {"object": "list", "data": [], "has_more": False, "next_after_seq": None}


def test_bad_page_parameters_are_named(gateway: RunningGateway) -> None:
    bad = [
        ({"limit": 0}, "limit"),
        ({"limit": 1001}, "limit"),
        ({"after_seq": "-1"}, "after_seq"),
        ({"limit": "x"}, "limit"),
        # each of these was once a 500: an int overflow in PostgreSQL, int("²"), and
        # Python's refusal to parse over 4,300 digits
        ({"after_seq": 2**31}, "after_seq"),
        ({"after_seq": 2**63}, "after_seq"),
        ({"after_seq": "\u00b2"}, "after_seq"),
        ({"limit": "\u00b9\u2070"}, "limit"),
        ({"limit": "٣"}, "limit"),  # an Arabic-Indic digit: isdigit(), and int() takes it
        ({"limit": "1" * 5000}, "limit"),
        ({"after_seq": "9" * 5000}, "after_seq"),
    ]
    with gateway.http(headers=ADMIN) as http:
        for params, param in bad:
            response = http.get("/v1/requests/req_fenced/events", params=params)
            assert response.status_code == 400
            error = response.json()["error"]
            assert error["param"] == param and error["code"] == "invalid_request"
            assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("request_id", ["a%00b", "a%01b", "%0a", "x" * 257, "a%7Fb"])
@pytest.mark.parametrize("suffix", ["/v1/requests/{}", "/v1/requests/{}/events", "/ui/requests/{}"])
def test_a_request_id_the_log_cannot_hold_is_400_not_500(gateway: RunningGateway, request_id: str, suffix: str) -> None:
    with gateway.http(headers=ADMIN) as http:
        response = http.get(suffix.format(request_id))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_request_id" and error["param"] == "request_id"
    assert error["request_id"] == response.headers["x-request-id"]


def test_the_highest_after_seq_is_an_empty_page(gateway: RunningGateway) -> None:
    with gateway.http(headers=ADMIN) as http:
        page = http.get("/v1/requests/req_fenced/events", params={"after_seq": 2**31 - 1}).json()
    assert page == {"object": "list", "data": [], "has_more": False, "next_after_seq": None}


def test_an_unknown_request_is_404(gateway: RunningGateway) -> None:
    for path in ("/v1/requests/req_nobody", "/v1/requests/req_nobody/events", "/ui/requests/req_nobody"):
        with gateway.http(headers=ADMIN) as http:
            response = http.get(path)
        assert response.status_code == 404
        error = response.json()["error"]
        assert error["code"] == "request_not_found" and "req_nobody" in error["message"]
        assert error["request_id"] == response.headers["x-request-id"]


WRONG = [
    (None, "missing admin token"),
    ("Bearer wrong", "incorrect admin token"),
    ("Bearer", "missing admin token"),
    ("Token s3cret-admin", "missing admin token"),
    ("Basic !!!", "missing admin token"),
    ("Basic " + base64.b64encode(b"ops:wrong").decode(), "incorrect admin token"),
]


@pytest.mark.parametrize(
    "path", ["/v1/requests/req_retried", "/v1/requests/req_retried/events", "/ui/requests/req_retried"]
)
def test_a_missing_or_wrong_token_is_401(gateway: RunningGateway, path: str) -> None:
    for authorization, message in WRONG:
        headers = {"authorization": authorization} if authorization else {}
        with gateway.http(headers=headers) as http:
            response = http.get(path)
        assert response.status_code == 401, authorization
        error = response.json()["error"]
        assert message in error["message"], authorization
        assert response.json() == {
            "error": {
                "message": error["message"],
                "type": "authentication_error",
                "param": None,
                "code": "invalid_admin_token",
                "request_id": response.headers["x-request-id"],
            }
        }
        asks_browser = response.headers.get("www-authenticate")
        assert (asks_browser is not None) == path.startswith("/ui/")


def test_a_browser_may_send_the_token_as_a_basic_password(gateway: RunningGateway) -> None:
    basic = "Basic " + base64.b64encode(f"anyone:{TOKEN}".encode()).decode()
    with gateway.http(headers={"authorization": basic}) as http:
        response = http.get("/ui/requests/req_interrupted")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    assert response.headers["cache-control"] == "no-store"
    page = response.text
    assert "<svg" in page and "failed: upstream_decode_interrupted" in page and "no divergence" in page


def test_without_an_admin_token_the_endpoints_are_disabled(database_url: str) -> None:
    load(database_url, "clean_completion")
    with running_gateway(database_url, []) as gateway, gateway.http(headers=ADMIN) as http:
        for path in ("/v1/requests/req_clean", "/v1/requests/req_clean/events", "/ui/requests/req_clean"):
            response = http.get(path)
            assert response.status_code == 403
            error = response.json()["error"]
            assert error["code"] == "admin_disabled" and "set admin_token" in error["message"]
            assert error["type"] == "permission_error"
