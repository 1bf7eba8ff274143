"""A drain's errors say one thing in the Responses API as in chat (docs/design.md §6, §11):
the streams it ends get a message that agrees with ``retryable``, and a request that
arrives meanwhile a 503 that promises no other instance. An in-process gateway, drained
while a real sim worker holds a response mid-stream."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from tests.app.api.test_responses_background import asked, reached
from tests.app.conftest import held
from tests.support.drain_errors import assert_ending_says_one_thing, assert_refusal_says_one_thing
from tests.support.gateway import MODEL, running_gateway
from tests.support.workers import WorkerProcess


def test_a_drained_response_stream_and_a_late_request(
    database_url: str, fresh_pair: list[WorkerProcess], unique_prompt: Callable[[str], str]
) -> None:
    prompt = unique_prompt("drained mid-stream")
    with (
        running_gateway(database_url, fresh_pair, timeouts={"stall_s": 60.0}) as gateway,
        held(fresh_pair[0], prompt, at_token=3) as release,
        ThreadPoolExecutor(2) as pool,
    ):
        client = gateway.openai()

        def read() -> list[Any]:
            return list(client.responses.create(**asked(prompt), stream=True))

        reading = pool.submit(read)
        deadline = time.monotonic() + 30
        while not gateway.gateway.ctx.drivers and time.monotonic() < deadline:
            time.sleep(0.05)
        (request_id,) = list(gateway.gateway.ctx.drivers)
        gateway.wait_logged(request_id, reached(2))
        draining = pool.submit(lambda: gateway.call(gateway.gateway.instance.drain(0.2)))
        deadline = time.monotonic() + 10
        while gateway.gateway.ctx.refusal is None and time.monotonic() < deadline:
            time.sleep(0.02)
        late = httpx.post(gateway.url + "/v1/responses", json={"model": MODEL, "input": "late"}, timeout=30)
        assert late.status_code == 503 and late.headers["retry-after"]
        assert_refusal_says_one_thing(late.json()["error"])
        events = reading.result(timeout=60)
        release()
        draining.result(timeout=30)
    assert events[-1].type == "response.failed"
    error = events[-1].response.error.model_dump()
    assert error["code"] == "gateway_draining"
    assert_ending_says_one_thing(error)
