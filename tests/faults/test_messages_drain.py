"""A message's stream at a gateway's drain (docs/design.md §11, §17): a real ``phasegate
serve`` takes SIGTERM while a message streams (held at its fifth token, past the drain, its
stall timeout longer than the drain); the stream ends with Anthropic's ``error`` event
carrying the §6 fields, ``delivered_output_tokens`` what the client received and the log
says, and a message sent during the drain is refused in Anthropic's shape."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from statemachine import events as ev
from statemachine.invariants import violations
from tests.app.conftest import held
from tests.faults import test_instances
from tests.faults.test_instances import gateways, read_logs, wait_for
from tests.support.gateway import MODEL
from tests.support.message_stream import read_message_stream
from tests.support.workers import WorkerProcess

pytestmark = pytest.mark.slow
worker = test_instances.worker  # the fixture: a sim worker at 40 ms a token


def test_a_message_streaming_at_a_drain_ends_with_the_error_event(
    database_url: str,
    worker: WorkerProcess,
    tmp_path: Path,
) -> None:
    frames: list[tuple[str, dict[str, Any]]] = []
    ids: list[str] = []
    ended = threading.Event()

    def stream(url: str) -> None:
        try:
            read_message_stream(url, "held at a drain", frames, ids)
        finally:
            ended.set()

    settings = test_instances.SETTINGS + "[timeouts]\nstall_s = 30.0\n"
    with gateways(database_url, worker, tmp_path, 1, settings) as (gateway,), held(worker, "held at a drain", 4):
        threading.Thread(target=stream, args=(gateway.url,), daemon=True).start()
        wait_for(lambda: len(frames) >= 4, 30, "the message to be delivering")
        gateway.process.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(gateway.url + "/readyz").status_code == 503, 2, "readiness to fail")
        late = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "late"}]}
        refused = httpx.post(gateway.url + "/v1/messages", json=late)
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert refused.json()["type"] == "error" and refused.json()["error"]["code"] == "gateway_draining"
        assert refused.json()["error"]["type"] == "overloaded_error"
        gateway.process.wait(20)
        assert ended.wait(10)
    kind, last = frames[-1]
    received = sum(1 for _, data in frames if data.get("delta", {}).get("type") == "text_delta")
    assert kind == "error" and last["error"]["code"] == "gateway_draining", frames[-3:]
    (logged,) = read_logs(database_url, ids).values()
    (failed,) = [e for e in logged if isinstance(e, ev.RequestFailed)]
    assert last["error"]["delivered_output_tokens"] == received == failed.delivered_output_tokens
    assert last["error"]["partial_output"] is failed.partial_output is True and violations(logged) == []
