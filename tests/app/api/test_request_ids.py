"""Request ids a client puts in a path (resume, cancel, audit): the fuzz suite found that an id
a header cannot hold (``Ā``) made resume and cancel answer 500, as they echoed it in
``x-request-id``; and a NUL reached PostgreSQL. Now: 400 ``invalid_request_id`` or 404, never
a 500, and the header only when it can carry the id. A real gateway over real sim workers."""

from __future__ import annotations

import pytest

from tests.support.gateway import RunningGateway


@pytest.mark.parametrize(
    ("path_id", "status", "code", "echoed"),
    [
        ("%C4%80", 404, "request_not_found", None),  # Ā: printable, not latin-1
        ("caf%C3%A9", 404, "request_not_found", None),  # é: latin-1, not ASCII
        ("a%00b", 400, "invalid_request_id", None),
        ("%ED%A0%80", 404, "request_not_found", None),  # a lone surrogate as bytes: decoded to U+FFFD
        ("1" * 300, 400, "invalid_request_id", "1" * 300),
        ("%20a", 404, "request_not_found", None),  # a space at an end: no header value
        ("a%20", 404, "request_not_found", None),
        ("a%20b", 404, "request_not_found", "a b"),
    ],
)
@pytest.mark.parametrize("route", ["stream", "cancel"])
def test_an_id_no_header_can_hold_is_refused_not_a_500(
    gateway: RunningGateway, path_id: str, status: int, code: str, echoed: str | None, route: str
) -> None:
    with gateway.http() as http:
        path = f"/v1/requests/{path_id}/{route}"
        response = http.get(path) if route == "stream" else http.post(path, json={})
    assert (response.status_code, response.json()["error"]["code"]) == (status, code), response.text
    assert response.headers.get("x-request-id") == echoed  # only where a header can hold it


def test_the_gateways_own_ids_are_still_echoed(gateway: RunningGateway) -> None:
    with gateway.http() as http:
        response = http.post("/v1/requests/req_0123456789abcdef01234567/cancel", json={})
    assert response.status_code == 404
    assert response.headers["x-request-id"] == "req_0123456789abcdef01234567"
