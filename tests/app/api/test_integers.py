"""Integers in headers, query parameters and paths: one parser with bounds
(app/contract/integers.py), so a 5,000-digit number, a "²" or a "+7" is a 400 naming the
parameter on every route that reads one, never a 500. Real gateway, real sim workers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from app.contract.integers import IntegerRefused, exceeds, parse_integer
from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.workers import WorkerProcess

TOKEN = "s3cret-admin"
HUGE = "9" * 5000  # past the 4,300 digits Python's int() takes
ODD = [HUGE, "²", "٣", "+7", " 7", "7_0", "-1", "1e3", "0x10", ""]


def test_the_parser_takes_ascii_digits_within_bounds_only() -> None:
    assert parse_integer("0042", "n", maximum=100) == 42
    assert parse_integer("7", "n", minimum=7, maximum=7) == 7
    for text in [*ODD, "101", "00000101", "6"]:
        with pytest.raises(IntegerRefused, match=r"n must be an integer from 7 to 100"):
            parse_integer(text, "n", minimum=7, maximum=100)
    with pytest.raises(IntegerRefused) as refused:
        parse_integer(HUGE, "n", maximum=10)
    assert len(str(refused.value)) < 120  # the value quoted, cut


def test_a_declared_length_is_compared_without_int_of_any_size() -> None:
    assert exceeds(HUGE, 1 << 20) is True
    assert exceeds("0" * 5000 + "5", 10) is False
    assert exceeds("11", 10) is True and exceeds("10", 10) is False
    assert exceeds("²", 10) is None and exceeds("", 10) is None


@pytest.fixture
def admin_gateway(database_url: str, sim_pair: list[WorkerProcess]) -> Iterator[RunningGateway]:
    with running_gateway(database_url, sim_pair, admin_token=TOKEN, resume_grace_s=0) as running:
        yield running


def test_every_integer_a_client_writes_is_a_400_naming_it(admin_gateway: RunningGateway) -> None:
    admin = {"authorization": f"Bearer {TOKEN}"}
    with admin_gateway.http(timeout=30) as http:
        chat = http.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )
        request_id = chat.headers["x-request-id"]
        created = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 16})
        response_id = created.json()["id"]
        cases: list[tuple[str, dict[str, str | bytes], str]] = []
        for text in ODD:
            if text and text.strip() == text:  # empty means "from the start"; HTTP strips the spaces around a value
                header = {"last-event-id": text.encode()}
                cases.append((f"/v1/requests/{request_id}/stream", header, "Last-Event-ID"))
            cases += [
                (f"/v1/requests/{request_id}/stream?after={text}", {}, "after"),
                (f"/v1/responses/{response_id}?stream=true&starting_after={text}", {}, "starting_after"),
                (f"/v1/responses/{response_id}/input_items?limit={text}", {}, "limit"),
                (f"/v1/requests/{request_id}/events?after_seq={text}", admin, "after_seq"),
                (f"/v1/requests/{request_id}/events?limit={text}", admin, "limit"),
            ]
        for path, headers, param in cases:
            if path.endswith(("?after=", "?after_seq=")):
                continue  # an empty value is no value for these
            answer = http.get(path, headers=headers)
            assert answer.status_code == 400, (path[:120], headers, answer.status_code, answer.text[:200])
            error = answer.json()["error"]
            assert error["param"] == param and "must be an integer from" in error["message"], (path[:120], error)
        listed = http.get(f"/ui/requests?limit={HUGE}", headers=admin)
        assert listed.status_code == 400 and "limit must be an integer from 1 to" in listed.text
