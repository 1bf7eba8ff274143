"""The disconnect grace (docs/design.md §12), with real workers, real sockets, the real `openai` client.

A client that leaves does not stop the generation for ``resume_grace_s``: a client that
comes back within it attaches to the live request and gets every delta exactly once;
one that does not come back is cancelled when the grace runs out, and the worker
acknowledges the cancel. Each test judges by what the clients received and by the log
(delivered against produced), and replays the log.

A test that needs the request still generating when its client comes back holds the
attempt at a token (the worker's ``hold`` fault) and releases it once the log shows the
client attached: never a sleep that hopes the answer is not over yet.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from ops.transcript import Transcript
from statemachine import events as ev
from statemachine.invariants import violations
from statemachine.replay import replay
from statemachine.request_state import Outcome
from statemachine.state import fold
from tests.app.conftest import add_fault, held
from tests.support.cut_proxy import CutBeforeHeaders
from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.transcript import of, stream_chat
from tests.support.transcript import resume_stream as resume
from tests.support.workers import WorkerProcess, running_worker

GRACE_S = 5.0  # long enough for a loaded machine's resume; the expiry test has its own
HELD = {"stall_s": 60.0}  # a held attempt publishes nothing: not a stall in these tests


@pytest.fixture(scope="module")
def slow_worker() -> Iterator[WorkerProcess]:
    with running_worker(faults=True, args=["--model", MODEL, "--sim-decode-ms-per-token", "30"]) as worker:
        yield worker


@pytest.fixture
def gateway(database_url: str, slow_worker: WorkerProcess) -> Iterator[RunningGateway]:
    with running_gateway(database_url, [slow_worker], resume_grace_s=GRACE_S, timeouts=HELD) as running:
        yield running


def body(prompt: str, max_tokens: int = 40) -> dict[str, Any]:
    messages = [{"role": "user", "content": prompt}]
    return {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "ignore_eos": True}


def read_stream(response: httpx.Response, transcript: Transcript, leave_after: int | None = None) -> None:
    for line in response.iter_lines():
        if transcript.read(line) and leave_after is not None and len(transcript.contents) >= leave_after:
            return  # the caller closes the connection: the client is gone


def delivered(events: list[ev.Event]) -> dict[int, str]:
    return _by_index(events, ev.DeltasDelivered)


def produced(events: list[ev.Event]) -> dict[int, str]:
    return _by_index(events, ev.DeltasProduced)


def _by_index(events: list[ev.Event], cls: type[ev.Event]) -> dict[int, str]:
    out: dict[int, str] = {}
    for event in of(events, cls):
        text, offset = event.text or "", 0  # type: ignore[attr-defined]
        for index, (_, chars, _) in enumerate(event.deltas, start=event.from_index):  # type: ignore[attr-defined]
            assert index not in out, f"delta {index} recorded twice as {cls.__name__}"
            out[index] = text[offset : offset + chars]
            offset += chars
    return out


def reached(index: int) -> Callable[[list[ev.Event]], bool]:
    """The log holds delta ``index``, delivered or produced."""
    return lambda events: index in delivered(events) or index in produced(events)


def resumed_times(count: int) -> Callable[[list[ev.Event]], bool]:
    return lambda events: len(of(events, ev.ClientResumed)) == count


def worker_attempts(worker: WorkerProcess, request_id: str) -> list[dict[str, Any]]:
    attempts = httpx.get(worker.base_url + "/admin/attempts", timeout=10).json()["attempts"]
    return [a for a in attempts if a["request_id"] == request_id]


def assert_log_sound(events: list[ev.Event]) -> None:
    assert violations(events) == [], violations(events)
    result = replay(events)
    assert result.ok, result.divergence and result.divergence.describe()


@pytest.mark.parametrize("left_at", [0, 3, 8])
def test_a_client_that_drops_mid_stream_and_resumes_within_the_grace_gets_every_delta_once(
    gateway: RunningGateway, slow_worker: WorkerProcess, left_at: int, unique_prompt: Callable[[str], str]
) -> None:
    prompt = unique_prompt(f"drop at {left_at}")
    # held where the client leaves, until the log says it left: what comes next is produced for
    # nobody (a loaded machine can otherwise send more to the closed socket before it notices)
    with held(slow_worker, prompt, at_token=left_at + 1) as release, ThreadPoolExecutor(1) as pool:
        first = stream_chat(gateway.url, body(prompt), on_delta=lambda n: n == left_at + 1)
        assert len(first.contents) == left_at + 1 and not first.done
        gateway.wait_logged(first.request_id, lambda events: bool(of(events, ev.ClientDisconnected)))
        release(hold_at=25)
        gateway.wait_logged(first.request_id, reached(24))  # deltas up to the hold, no client attached
        later = pool.submit(resume, gateway.url, first.request_id, left_at)
        gateway.wait_logged(first.request_id, resumed_times(1))
        release()
        resumed = later.result(timeout=60)
    assert resumed.status == 200 and resumed.done and resumed.error is None
    n = len(resumed.contents)
    assert first.event_ids[: left_at + 1] == list(range(left_at + 1))
    assert resumed.event_ids[:n] == list(range(left_at + 1, left_at + 1 + n))  # none missing, none twice
    answer = first.text + resumed.text
    assert len(first.contents) + n == 40

    events = gateway.events(first.request_id)
    state = fold(events)
    assert state.outcome is Outcome.COMPLETED and len(state.attempts) == 1
    sent = delivered(events)
    assert sorted(sent) == list(range(40)) and "".join(sent[i] for i in range(40)) == answer  # the log agrees
    made = produced(events)
    assert made, "nothing was produced while the client was away"
    assert all(sent[i] == text for i, text in made.items())  # every produced delta was then delivered
    gone = [e for e in events if isinstance(e, ev.ClientDisconnected)]
    back = [e for e in events if isinstance(e, ev.ClientResumed)]
    assert [e.resume_grace_s for e in gone] == [GRACE_S] and [e.after for e in back] == [left_at]
    assert gone[0].seq < min(e.seq for e in of(events, ev.DeltasProduced)) < back[0].seq
    assert not of(events, ev.CancelSent) and not of(events, ev.ResumeGraceExpired)
    (attempt,) = worker_attempts(slow_worker, first.request_id)  # one generation at the worker
    assert attempt["generated_tokens"] == 40
    assert_log_sound(events)


def test_a_client_that_does_not_come_back_is_cancelled_when_the_grace_runs_out(
    database_url: str, slow_worker: WorkerProcess
) -> None:
    grace = 0.5
    with running_gateway(database_url, [slow_worker], resume_grace_s=grace) as gateway:
        first = stream_chat(gateway.url, body("never back", max_tokens=2000), on_delta=lambda n: n == 3)
        events = gateway.events(first.request_id)
        later = resume(gateway.url, first.request_id, 2)  # from the log, once it ended
    state = fold(events)
    assert state.outcome is Outcome.CANCELLED and len(state.attempts) == 1
    order = [type(e).__name__ for e in events]
    expected = ["ClientDisconnected", "DeltasProduced", "ResumeGraceExpired", "CancelSent", "RequestCancelled"]
    assert [order.index(name) for name in expected] == sorted(order.index(name) for name in expected)
    assert order.index("CancelSent") < order.index("CancelAcked")
    (gone,) = of(events, ev.ClientDisconnected)
    (expired,) = of(events, ev.ResumeGraceExpired)
    assert (expired.occurred_at - gone.occurred_at).total_seconds() >= grace
    (acked,) = of(events, ev.CancelAcked)
    (released,) = of(events, ev.AttemptReleased)
    assert released.because is ev.ReleaseReason.CANCEL_ACKED  # type: ignore[attr-defined]
    (attempt,) = worker_attempts(slow_worker, first.request_id)
    # stopped by the cancel, or by the stream closing as it was sent (as tests/app/driver/test_failover.py)
    assert attempt["stop"] in {"cancelled", "disconnected"} and attempt["engine_over"]
    assert 3 < acked.generated_tokens < 2000  # type: ignore[attr-defined]  # it went on, then stopped
    # what the client had, what was only produced, and a resumer gets the rest, then the end
    sent, made = delivered(events), produced(events)
    assert "".join(sent[i] for i in range(3)) == first.text and state.delivered_deltas >= 3
    assert made and min(made) == state.delivered_deltas and state.produced_deltas == max(made) + 1
    assert later.status == 200 and later.done and later.error is not None
    assert later.error["code"] == "request_cancelled"
    assert later.text == "".join(({**sent, **made})[i] for i in range(3, state.produced_deltas))
    assert_log_sound(events)


def test_a_stop_button_ends_a_request_left_in_its_grace_at_once(gateway: RunningGateway) -> None:
    first = stream_chat(gateway.url, body("stop it", max_tokens=2000), on_delta=lambda n: n == 2)
    asked = time.monotonic()
    answer = httpx.post(f"{gateway.url}/v1/requests/{first.request_id}/cancel", timeout=30)
    assert answer.status_code == 200 and answer.json()["status"] == "cancelled"
    events = gateway.events(first.request_id)
    assert time.monotonic() - asked < GRACE_S  # it did not wait out the grace
    (cancelled,) = of(events, ev.RequestCancelled)
    assert cancelled.reason == "cancelled_by_client"  # type: ignore[attr-defined]
    assert of(events, ev.ClientDisconnected) and not of(events, ev.ResumeGraceExpired)
    assert_log_sound(events)


def test_a_resume_that_arrives_before_the_gateway_saw_the_drop_attaches_to_the_live_request(
    database_url: str, slow_worker: WorkerProcess, unique_prompt: Callable[[str], str]
) -> None:
    """A client that reconnects at once can be ahead of its old connection's end (seen in CI:
    the EventSource case on a loaded machine). The resume waits for the instance to see
    the drop and attaches; followed from the log, the request would wait out its grace
    with no client attached and be cancelled under the resumed stream."""
    prompt = unique_prompt("not seen leaving")
    with (
        running_gateway(database_url, [slow_worker], resume_grace_s=1.0, timeouts=HELD) as gateway,
        held(slow_worker, prompt, at_token=50) as release,
    ):
        request = {**body(prompt, max_tokens=100), "stream": True}
        with httpx.Client(base_url=gateway.url, timeout=60) as http, ThreadPoolExecutor(1) as pool:
            with http.stream("POST", "/v1/chat/completions", json=request) as old:
                first = Transcript(old.headers["x-request-id"], old.status_code)
                lines = old.iter_lines()
                while len(first.contents) < 3:
                    first.read(next(lines))
                # the old connection stays open, unread: the gateway still serves it
                later = pool.submit(resume, gateway.url, first.request_id, first.event_ids[-1])
                time.sleep(0.5)  # the resume is in; on a loaded machine it may come after the close, as usual
            http.close()  # the old connection ends
            gateway.wait_logged(first.request_id, resumed_times(1))
            release()
            resumed = later.result(timeout=60)
        events = gateway.events(first.request_id)
    assert resumed.status == 200 and resumed.done and resumed.error is None, resumed.error
    assert resumed.event_ids[: len(resumed.contents)] == list(range(3, 100))  # none missing, none twice
    state = fold(events)
    assert state.outcome is Outcome.COMPLETED, state.outcome
    assert [e.after for e in of(events, ev.ClientResumed)] == [2]  # type: ignore[attr-defined]
    assert not of(events, ev.ResumeGraceExpired) and not of(events, ev.StreamResumed)
    sent = delivered(events)
    assert "".join(sent[i] for i in range(100)) == first.text + resumed.text  # the log agrees
    assert_log_sound(events)


def test_a_reconnecting_sse_client_resumes_with_last_event_id_as_event_source_does(
    gateway: RunningGateway, slow_worker: WorkerProcess, unique_prompt: Callable[[str], str]
) -> None:
    """As a browser's EventSource: on a drop it sends the same request again, with
    ``Last-Event-ID``; the Idempotency-Key binds the retries to one request."""
    headers = {"idempotency-key": f"es-{uuid.uuid4().hex}"}
    got = Transcript("", 0)
    request_ids = set()
    drops = [2, 7]  # the connection drops after these many deltas
    prompt = unique_prompt("event source")

    def release_when_attached(request_id: str) -> None:
        gateway.wait_logged(request_id, resumed_times(len(drops)))
        release()

    with held(slow_worker, prompt, at_token=30) as release, ThreadPoolExecutor(1) as pool:
        for attempt in range(5):
            if got.event_ids:
                headers["last-event-id"] = str(got.event_ids[-1])
            with (
                httpx.Client(base_url=gateway.url, timeout=60) as http,
                http.stream(
                    "POST", "/v1/chat/completions", json={**body(prompt), "stream": True}, headers=headers
                ) as response,
            ):
                assert response.status_code == 200, response.read()
                request_ids.add(response.headers["x-request-id"])
                if attempt == len(drops):  # the last connection: the hold ends once it is attached
                    pool.submit(release_when_attached, response.headers["x-request-id"])
                read_stream(response, got, leave_after=drops[attempt] if attempt < len(drops) else None)
            if got.done:
                break
            time.sleep(0.2)
    (request_id,) = request_ids
    assert got.done and got.error is None and len(got.contents) == 40
    assert [i for i in got.event_ids if i < 40] == list(range(40))  # every delta once, in order
    events = gateway.events(request_id)
    sent = delivered(events)
    # a reconnect ahead of the old connection's end was followed from the log, and
    # deltas 30-39 went out as resumed, not delivered (see the test above); the shape
    # of the log says where they went should it happen again
    shape = [(type(e).__name__, getattr(e, "from_index", None)) for e in events]
    assert sorted(sent) == list(range(40)), shape
    assert "".join(sent[i] for i in range(40)) == got.text
    assert [e.after for e in of(events, ev.ClientResumed)] == [1, 6]  # type: ignore[attr-defined]
    assert len(of(events, ev.RequestAccepted)) == 1
    assert len(worker_attempts(slow_worker, request_id)) == 1  # one generation
    assert_log_sound(events)


def test_the_openai_client_retries_a_post_cut_before_its_headers_and_the_worker_generates_once(
    gateway: RunningGateway, slow_worker: WorkerProcess
) -> None:
    port = int(gateway.url.rsplit(":", 1)[1])
    key = f"sdk-{uuid.uuid4().hex}"
    with CutBeforeHeaders(port) as proxy:
        client = gateway.openai(max_retries=2)
        client = client.with_options(base_url=f"http://127.0.0.1:{proxy.port}/v1")
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": "sdk retry"}],
            max_tokens=40,
            stream=True,
            extra_body={"ignore_eos": True},
            extra_headers={"Idempotency-Key": key},
        )
        request_id = raw.headers["x-request-id"]
        text = "".join(chunk.choices[0].delta.content or "" for chunk in raw.parse() if chunk.choices)
    assert proxy.cut.is_set() and proxy.connections == 2  # cut once, retried once by the SDK
    events = gateway.events(request_id)
    state = fold(events)
    assert state.outcome is Outcome.COMPLETED and len(of(events, ev.RequestAccepted)) == 1
    sent = delivered(events)
    assert "".join(sent[i] for i in range(len(sent))) == text and len(sent) == 40
    (attempt,) = worker_attempts(slow_worker, request_id)  # ONE generation, counted at the worker
    assert attempt["generated_tokens"] == 40
    assert of(events, ev.ClientDisconnected)  # the cut connection was a client that left
    assert_log_sound(events)


def test_a_resume_that_reaches_another_instance_is_forwarded_to_the_owner_and_attaches(
    database_url: str, slow_worker: WorkerProcess, unique_prompt: Callable[[str], str]
) -> None:
    prompt = unique_prompt("elsewhere")
    with (
        running_gateway(database_url, [slow_worker], resume_grace_s=GRACE_S, timeouts=HELD) as owner,
        running_gateway(database_url, [slow_worker], resume_grace_s=GRACE_S, timeouts=HELD) as other,
        held(slow_worker, prompt, at_token=20) as release,
        ThreadPoolExecutor(1) as pool,
    ):
        first = stream_chat(owner.url, body(prompt), on_delta=lambda n: n == 4)
        later = pool.submit(resume, other.url, first.request_id, 3)
        owner.wait_logged(first.request_id, resumed_times(1))
        release()
        resumed = later.result(timeout=60)
        events = owner.events(first.request_id)
    assert resumed.status == 200 and resumed.done and resumed.error is None
    assert resumed.event_ids[: len(resumed.contents)] == list(range(4, 40))
    assert fold(events).outcome is Outcome.COMPLETED
    sent = delivered(events)
    assert "".join(sent[i] for i in range(40)) == first.text + resumed.text
    (back,) = of(events, ev.ClientResumed)
    assert back.gateway == owner.gateway.instance_id  # type: ignore[attr-defined]  # attached at the owner
    assert not of(events, ev.StreamResumed)  # nothing appended by the other instance
    assert_log_sound(events)


def test_a_client_that_gives_up_before_the_first_delta_resumes_and_its_first_delta_is_the_commit_point(
    gateway: RunningGateway, slow_worker: WorkerProcess, unique_prompt: Callable[[str], str]
) -> None:
    prompt = unique_prompt("gives up before its first delta")
    with held(slow_worker, prompt, at_token=0) as release, ThreadPoolExecutor(1) as pool:
        with pytest.raises(httpx.ReadTimeout):  # no header yet: they are held back until the first delta
            stream_chat(gateway.url, body(prompt), timeout=0.3)
        (request_id,) = gateway.gateway.ctx.drivers  # the one request in flight, still generating
        gateway.wait_logged(request_id, lambda events: of(events, ev.ClientDisconnected))
        release(hold_at=10)  # deltas are produced with no client attached
        gateway.wait_logged(request_id, reached(9))
        later = pool.submit(resume, gateway.url, request_id)
        gateway.wait_logged(request_id, resumed_times(1))
        release()
        resumed = later.result(timeout=60)
    assert resumed.status == 200 and resumed.done and resumed.error is None
    assert resumed.event_ids[:40] == list(range(40)) and len(resumed.contents) == 40
    events = gateway.events(request_id)
    order = [type(e).__name__ for e in events]
    assert fold(events).outcome is Outcome.COMPLETED
    # produced in prefill, then the commit point when a client first received a delta
    assert order.index("ClientDisconnected") < order.index("DeltasProduced") < order.index("ClientResumed")
    assert order.index("ClientResumed") < order.index("FirstDeltaCommitted") < order.index("DeltasDelivered")
    sent = delivered(events)
    assert "".join(sent[i] for i in range(40)) == resumed.text
    assert len(worker_attempts(slow_worker, request_id)) == 1
    assert_log_sound(events)


def test_a_replica_that_dies_while_no_client_is_attached_ends_the_request_and_a_resumer_gets_that_error(
    database_url: str,
) -> None:
    prompt = "dies while nobody listens"
    with (
        running_worker(faults=True, args=["--model", MODEL, "--sim-decode-ms-per-token", "30"]) as dying,
        running_gateway(database_url, [dying], resume_grace_s=GRACE_S) as gateway,
    ):
        add_fault(dying, action="die", point="after_frame", at_token=15, match={"prompt_contains": prompt})
        first = stream_chat(gateway.url, body(prompt), on_delta=lambda n: n == 3)
        events = gateway.events(first.request_id)  # settled: the request ended while nobody was attached
        resumed = resume(gateway.url, first.request_id, 2)
    state = fold(events)
    (failed,) = of(events, ev.RequestFailed)
    assert state.outcome is Outcome.FAILED and len(state.attempts) == 1  # no second generation
    assert (failed.code, failed.partial_output, failed.retryable) == ("upstream_decode_interrupted", True, False)  # type: ignore[attr-defined]
    assert failed.delivered_output_tokens == state.delivered_output_tokens >= 3  # type: ignore[attr-defined]
    made = produced(events)
    assert made and state.produced_deltas > state.delivered_deltas  # output nobody received live
    assert resumed.done and resumed.error is not None
    assert resumed.error["code"] == "upstream_decode_interrupted"
    assert resumed.error["delivered_output_tokens"] == failed.delivered_output_tokens  # type: ignore[attr-defined]
    everything = {**delivered(events), **made}
    assert resumed.text == "".join(everything[i] for i in range(3, state.produced_deltas))
    assert_log_sound(events)


def test_a_whole_answer_whose_client_left_is_answered_to_its_idempotent_retry_from_the_same_generation(
    gateway: RunningGateway, slow_worker: WorkerProcess, unique_prompt: Callable[[str], str]
) -> None:
    key = f"whole-{uuid.uuid4().hex}"
    prompt = unique_prompt("whole answer, retried")
    request = {**body(prompt), "stream": False}
    url, headers = f"{gateway.url}/v1/chat/completions", {"idempotency-key": key}
    with held(slow_worker, prompt, at_token=0) as release, ThreadPoolExecutor(1) as pool:
        with pytest.raises(httpx.ReadTimeout):  # held: the client gives up first
            httpx.post(url, json=request, headers=headers, timeout=0.3)
        (request_id,) = gateway.gateway.ctx.drivers
        gateway.wait_logged(request_id, lambda events: of(events, ev.ClientDisconnected))
        release(hold_at=10)  # deltas are produced with no client attached
        gateway.wait_logged(request_id, reached(9))
        later = pool.submit(httpx.post, url, json=request, headers=headers, timeout=60)
        gateway.wait_logged(request_id, resumed_times(1))
        release()
        answer = later.result(timeout=60)
    assert answer.status_code == 200 and answer.headers["x-request-id"] == request_id
    text = answer.json()["choices"][0]["message"]["content"]
    events = gateway.events(request_id)
    order = [type(e).__name__ for e in events]
    assert fold(events).outcome is Outcome.COMPLETED
    assert order.index("ClientDisconnected") < order.index("DeltasProduced") < order.index("ClientResumed")
    assert order.index("ClientResumed") < order.index("FirstDeltaCommitted")
    sent = delivered(events)
    assert len(sent) == 40 and "".join(sent[i] for i in range(40)) == text
    (attempt,) = worker_attempts(slow_worker, request_id)  # one generation
    assert attempt["generated_tokens"] == 40
    assert_log_sound(events)
