"""``POST /v1/requests/{id}/cancel`` (docs/design.md §12): a stop button ends a request at once.

Real gateways on one PostgreSQL, a real sim worker, raw SSE. The stream being read
ends with the final error ``request_cancelled``; the log records ``RequestCancelled``
(``cancelled_by_client``) and the attempt's cancel and its acknowledgement; another
instance forwards the call to the one that owns the request.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from ops.transcript import Transcript
from statemachine import events as ev
from statemachine.events import ReleaseReason
from statemachine.replay import replay
from statemachine.request_state import Outcome
from statemachine.state import fold
from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.transcript import of, stream_chat
from tests.support.workers import WorkerProcess, running_worker


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    with running_worker(args=["--model", MODEL, "--sim-decode-ms-per-token", "30"]) as w:
        yield w


def long_stream(gateway: RunningGateway) -> tuple[list[Transcript], threading.Thread, str]:
    """A long stream in a thread, once it delivers: (its transcript when done, the thread, its id)."""
    seen: list[int] = []
    done: list[Transcript] = []
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}], "max_tokens": 400, "ignore_eos": True}
    thread = threading.Thread(target=lambda: done.append(stream_chat(gateway.url, body, on_delta=seen.append)))
    thread.start()
    deadline = time.monotonic() + 30
    while len(seen) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    (request_id,) = gateway.gateway.ctx.drivers
    return done, thread, request_id


@pytest.mark.parametrize("through", ["owner", "another instance"])
def test_a_stop_ends_the_stream_at_once_with_its_final_error(
    database_url: str, worker: WorkerProcess, through: str
) -> None:
    with running_gateway(database_url, [worker]) as owner, running_gateway(database_url, [worker]) as other:
        done, thread, request_id = long_stream(owner)
        target = owner if through == "owner" else other
        answer = httpx.post(f"{target.url}/v1/requests/{request_id}/cancel", timeout=30)
        assert answer.status_code == 200 and answer.json()["status"] == "cancelled"
        thread.join(30)
        (transcript,) = done
        assert transcript.done and transcript.error is not None
        assert transcript.error["code"] == "request_cancelled" and len(transcript.contents) < 400
        owner.settle()
        events = owner.events(request_id)
        state = fold(events)
        assert state.outcome is Outcome.CANCELLED and state.error_code == "cancelled_by_client"
        assert transcript.error["delivered_output_tokens"] == state.delivered_output_tokens
        assert state.delivered_deltas == len(transcript.contents)
        (released,) = of(events, ev.AttemptReleased)
        assert of(events, ev.CancelSent) and released.because is ReleaseReason.CANCEL_ACKED  # type: ignore[attr-defined]
        assert replay(events).ok
        again = httpx.post(f"{target.url}/v1/requests/{request_id}/cancel", timeout=30)
        assert again.json() == {"object": "request.cancel", "id": request_id, "status": "ended", "outcome": "cancelled"}


def test_only_the_requests_tenant_may_stop_it(database_url: str, worker: WorkerProcess) -> None:
    keys = {"key-of-acme-0123456789": "acme", "key-of-globex-0123456789": "globex"}
    with running_gateway(database_url, [worker], api_keys=keys) as gateway:
        acme = {"authorization": "Bearer key-of-acme-0123456789"}
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        request_id = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, headers=acme).headers["x-request-id"]
        gateway.settle()
        other = httpx.post(
            f"{gateway.url}/v1/requests/{request_id}/cancel",
            headers={"authorization": "Bearer key-of-globex-0123456789"},
        )
        assert other.status_code == 404 and other.json()["error"]["code"] == "request_not_found"
        assert httpx.post(f"{gateway.url}/v1/requests/{request_id}/cancel").status_code == 401
