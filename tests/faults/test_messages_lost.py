"""A message's stream at a gateway that lost its lease (docs/design.md §11, §17): a real
``phasegate serve`` is stopped (SIGSTOP) past its lease while a message streams; a
survivor sweeps it, closing the request ``gateway_lost``; once resumed, the gateway ends
the stream with Anthropic's ``error`` event carrying the §6 fields, its
``delivered_output_tokens`` the text deltas the client received, and the log agrees
(``RequestFailed`` with that code, at most two batches behind the client, never ahead)."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from statemachine import events as ev
from statemachine.invariants import violations
from statemachine.state import fold
from tests.faults import test_instances
from tests.faults.test_instances import BATCH, gateways, logged_deltas, read_logs, terminal, wait_for
from tests.support.message_stream import read_message_stream
from tests.support.workers import WorkerProcess

pytestmark = pytest.mark.slow
worker = test_instances.worker  # the fixture: a sim worker at 40 ms a token


def test_a_message_streaming_at_a_lost_lease_ends_with_the_error_event(
    database_url: str,
    worker: WorkerProcess,
    tmp_path: Path,
) -> None:
    frames: list[tuple[str, dict[str, Any]]] = []
    ids: list[str] = []
    cut: list[BaseException] = []
    ended = threading.Event()

    def stream(url: str) -> None:
        try:
            read_message_stream(url, "count slowly", frames, ids)
        except httpx.HTTPError as exc:  # the gateway died under it: a defect here
            cut.append(exc)
        finally:
            ended.set()

    def texts() -> list[str]:
        return [data["delta"]["text"] for _, data in frames if data.get("delta", {}).get("type") == "text_delta"]

    with gateways(database_url, worker, tmp_path, 2) as (paused, _survivor):
        threading.Thread(target=stream, args=(paused.url,), daemon=True).start()
        wait_for(lambda: len(texts()) >= 3 or ended.is_set(), 30, "the message to be delivering")
        assert not ended.is_set(), frames
        paused.process.send_signal(signal.SIGSTOP)
        try:
            wait_for(lambda: all(map(terminal, read_logs(database_url, ids).values())), 30, "the sweep")
        finally:
            paused.process.send_signal(signal.SIGCONT)
        assert ended.wait(15), "the resumed gateway did not end the stream"
    assert cut == []
    kind, last = frames[-1]
    received = texts()
    assert kind == "error" and last["type"] == "error", frames[-3:]
    error = last["error"]
    assert error["code"] == "gateway_lost" and error["delivered_output_tokens"] == len(received)
    assert error["partial_output"] is True and error["retryable"] is False
    (logged,) = read_logs(database_url, ids).values()
    assert violations(logged) == []
    (failed,) = [e for e in logged if isinstance(e, ev.RequestFailed)]
    assert failed.code == "gateway_lost" and failed.partial_output is True and failed.retryable is False
    # the log is behind the client by at most two batches and never ahead of it
    assert failed.delivered_output_tokens == fold(logged).delivered_output_tokens == logged_deltas(logged)
    assert len(received) - 2 * BATCH <= failed.delivered_output_tokens <= len(received)
    logged_text = "".join(e.text or "" for e in logged if isinstance(e, ev.DeltasDelivered))
    assert "".join(received).startswith(logged_text)
