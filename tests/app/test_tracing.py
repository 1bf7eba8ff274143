"""OpenTelemetry at the HTTP layer, with the SDK's in-memory exporter and real requests.

A real gateway serves chats from a real sim worker and from an OpenAI-compatible upstream
(tests/support/scripted_upstream.py), each reached through a TCP proxy that keeps the
bytes the gateway sent. With tracing on, each generation request is one SERVER span
carrying its request id, the child of the client's W3C ``traceparent`` when it sent one,
and the replica received that span's ``traceparent``. Under it, each attempt is a span
that says what the log says of it (replica, lease epoch, phase, outcome, the commit
point, the fence, the cancel acknowledgement), and ``RequestAccepted`` records the trace
id, which the request's JSON and timeline page show. With tracing off (the default) no
span is made and no ``traceparent`` leaves the gateway. Last, the attempt spans made from
recorded event sequences alone (ops/traces.py): how each way an attempt
ends ends its span, and the bound on the requests followed.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import httpx
import pytest

from app.config import ReplicaConfig, Timeouts
from app.telemetry import tracing
from ops import traces
from statemachine import events as ev
from statemachine.request_state import RequestState
from statemachine.state import apply
from tests.app.conftest import add_fault
from tests.support.gateway import MODEL, running_gateway
from tests.support.scripted_upstream import running_scripted_upstream
from tests.support.tcp_proxy import TcpProxy, tcp_proxy
from tests.support.transcript import of
from tests.support.workers import WorkerProcess, running_worker

sdk_trace = pytest.importorskip("opentelemetry.sdk.trace", reason="the otel extra is not installed")
in_memory = pytest.importorskip("opentelemetry.sdk.trace.export.in_memory_span_exporter")
export = pytest.importorskip("opentelemetry.sdk.trace.export")

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = "00f067aa0ba902b7"
TRACEPARENT = re.compile(rb"traceparent: 00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}", re.IGNORECASE)


@pytest.fixture
def spans() -> Iterator[Any]:
    exporter = in_memory.InMemorySpanExporter()
    provider = sdk_trace.TracerProvider()
    provider.add_span_processor(export.SimpleSpanProcessor(exporter))
    tracing.install(provider)
    try:
        yield exporter
    finally:
        tracing.uninstall()
        provider.shutdown()


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    with running_worker(args=["--model", MODEL, "--sim-decode-ms-per-token", "2"]) as running:
        yield running


def chat(url: str, headers: dict[str, str] | None = None) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "trace me"}], "max_tokens": 4, "stream": True}
    with httpx.Client(base_url=url, timeout=30) as http:
        response = http.post("/v1/chat/completions", json=body, headers=headers or {})
    assert response.status_code == 200 and "[DONE]" in response.text
    return response


def sent_traceparents(proxy: TcpProxy) -> list[tuple[str, str]]:
    return [(t.decode(), s.decode()) for t, s in TRACEPARENT.findall(bytes(proxy.forwarded))]


@pytest.mark.parametrize("kind", ["worker", "openai"])
def test_a_request_is_a_span_and_its_replica_gets_its_traceparent(
    spans: Any, database_url: str, worker: WorkerProcess, kind: str
) -> None:
    with running_scripted_upstream() as upstream:
        target = worker.base_url if kind == "worker" else upstream.base_url
        with (
            tcp_proxy(target) as proxy,
            running_gateway(
                database_url, [ReplicaConfig(id="r1", url=proxy.url, kind=kind)], health_interval_s=30
            ) as gateway,
        ):
            proxy.forwarded.clear()  # the start's health probe: not a request's
            spans.clear()
            joined = chat(gateway.url, {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"})
            alone = chat(gateway.url)
            gateway.settle()
    (joined_span, alone_span) = [s for s in spans.get_finished_spans() if s.name == "POST /v1/chat/completions"]
    assert joined_span.attributes["phasegate.request_id"] == joined.headers["x-request-id"]
    assert alone_span.attributes["phasegate.request_id"] == alone.headers["x-request-id"]
    assert joined_span.attributes["http.response.status_code"] == 200
    assert joined_span.kind.name == "SERVER"
    # the client's trace goes on: its span is the parent
    assert format(joined_span.context.trace_id, "032x") == CLIENT_TRACE
    assert joined_span.parent is not None and format(joined_span.parent.span_id, "016x") == CLIENT_PARENT
    assert alone_span.parent is None and format(alone_span.context.trace_id, "032x") != CLIENT_TRACE
    # the replica got each request span's traceparent (on the start, the cancel), and no other trace
    # (the lease renewals, shared by the replica's requests, carry none)
    sent = set(sent_traceparents(proxy))
    for span in (joined_span, alone_span):
        assert (format(span.context.trace_id, "032x"), format(span.context.span_id, "016x")) in sent, sent
    assert {trace for trace, _ in sent} == {
        format(joined_span.context.trace_id, "032x"),
        format(alone_span.context.trace_id, "032x"),
    }


def test_with_tracing_off_nothing_is_traced_or_sent(database_url: str, worker: WorkerProcess) -> None:
    assert tracing._tracer is None  # off unless configured
    with (
        tcp_proxy(worker.base_url) as proxy,
        running_gateway(database_url, [ReplicaConfig(id="r1", url=proxy.url)], health_interval_s=30) as gateway,
    ):
        answered = chat(gateway.url, {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"})
        (accepted,) = of(gateway.events(answered.headers["x-request-id"]), ev.RequestAccepted)
    assert b"POST /v1/attempts" in bytes(proxy.forwarded) or proxy.forwarded  # the attempt went through
    assert sent_traceparents(proxy) == []
    assert accepted.trace_id is None  # type: ignore[attr-defined]


# a stall found in 1.5 s; the lease long (the worker acknowledges the cancel, so the fence
# does not wait for it): at 1 s a loaded machine let it lapse unrenewed too, a second
# failure of attempt 1
FAST = Timeouts(stall_s=1.5, lease_ttl_s=10.0, cancel_ack_s=5.0, first_token_soft_s=0.3, first_token_hard_s=5.0)
ADMIN_TOKEN = "tracing-admin-token"


def nanoseconds(at: datetime) -> int:
    return int(at.timestamp() * 1e9)


def test_each_attempt_is_a_child_span_saying_what_the_log_says(
    spans: Any, database_url: str, sim_pair: list[WorkerProcess], unique_prompt: Callable[[str], str]
) -> None:
    """Attempt 1 stalls in prefill: fenced, its cancel acknowledged, then attempt 2 answers."""
    prompt = unique_prompt("trace a fence then a retry")
    for worker in sim_pair:
        add_fault(worker, action="stall", at_token=0, match={"prompt_contains": prompt, "attempt": 1})
    with running_gateway(database_url, sim_pair, timeouts=FAST, admin_token=ADMIN_TOKEN) as gateway:
        spans.clear()
        client = gateway.openai()
        with client.chat.completions.with_streaming_response.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=6, stream=True
        ) as response:
            request_id = response.headers["x-request-id"]
            text = "".join(chunk.choices[0].delta.content or "" for chunk in response.parse() if chunk.choices)
        events = gateway.events(request_id)
        with gateway.http(headers={"authorization": f"Bearer {ADMIN_TOKEN}"}) as http:
            summary = http.get(f"/v1/requests/{request_id}").json()
            page = http.get(f"/ui/requests/{request_id}").text
    assert text

    finished = spans.get_finished_spans()
    (request_span,) = [s for s in finished if s.name == "POST /v1/chat/completions"]
    attempt_spans = sorted((s for s in finished if s.name.startswith("attempt ")), key=lambda s: s.name)
    assert [s.name for s in attempt_spans] == ["attempt 1", "attempt 2"]
    trace_id = format(request_span.context.trace_id, "032x")
    for span in attempt_spans:  # children of the request's span, in its trace
        assert span.parent is not None and span.parent.span_id == request_span.context.span_id
        assert format(span.context.trace_id, "032x") == trace_id
        assert span.kind.name == "CLIENT"

    # each span is its attempt as the log recorded it
    started = {e.attempt: e for e in of(events, ev.AttemptStarted)}  # type: ignore[attr-defined]
    assert set(started) == {1, 2}
    for number, span in enumerate(attempt_spans, start=1):
        assert span.attributes["phasegate.request_id"] == request_id
        assert span.attributes["phasegate.attempt"] == number
        assert span.attributes["phasegate.replica"] == started[number].replica_id
        assert span.attributes["phasegate.lease_epoch"] == started[number].lease_epoch
        assert span.start_time == nanoseconds(started[number].occurred_at)
    assert started[1].replica_id != started[2].replica_id

    first, second = attempt_spans
    (released,) = of(events, ev.AttemptReleased)
    assert released.attempt == 1  # type: ignore[attr-defined]
    assert first.attributes["phasegate.outcome"] == "cancel_acked" == released.because.value  # type: ignore[attr-defined]
    assert first.attributes["phasegate.phase"] == "fenced"
    assert first.status.status_code.name == "ERROR" and "liveness_uncertain" in first.status.description
    assert [e.name for e in first.events] == ["upstream_failed", "fenced", "cancel_sent", "cancel_acked"]
    assert first.events[0].attributes["phasegate.kind"] == "liveness_uncertain"
    assert first.events[1].attributes["phasegate.waiting_for"] == "cancel_ack_or_lease_expiry"
    assert first.end_time == nanoseconds(released.occurred_at) <= second.start_time  # fenced before the retry

    (commit,) = of(events, ev.FirstDeltaCommitted)
    assert commit.attempt == 2  # type: ignore[attr-defined]
    assert second.attributes["phasegate.outcome"] == "completed"
    assert second.attributes["phasegate.phase"] == "decode"
    assert second.status.status_code.name == "UNSET"
    assert [e.name for e in second.events] == ["first_token_received", "first_delta_committed"]
    assert second.events[1].timestamp == nanoseconds(commit.occurred_at)
    (completed,) = of(events, ev.RequestCompleted)
    assert second.end_time == nanoseconds(completed.occurred_at)

    # the log, the request's JSON and its timeline page name the trace
    (accepted,) = of(events, ev.RequestAccepted)
    assert accepted.trace_id == trace_id  # type: ignore[attr-defined]
    assert summary["trace_id"] == trace_id
    assert trace_id in page


# --- the spans from the log's events alone (the events the driver records, built by the fold) ---


def feed(attempt_spans: tracing.AttemptSpans, trace: traces.Trace) -> None:
    """Hand ``attempt_spans`` the trace's events as the recorder does, each with the state it made."""
    state = RequestState(request_id=trace.request_id)
    for event in trace.events:
        state = apply(state, event)
        attempt_spans.recorded(state, event)


@pytest.mark.parametrize(
    ("scenario", "outcome", "phase", "fence_events", "ended_by"),
    [
        (traces.stalled_in_decode, "cancel_acked", "fenced", ["cancel_sent", "cancel_acked"], ev.AttemptReleased),
        (traces.fenced_then_retried, "lease_expired", "fenced", ["cancel_sent", "lease_expired"], ev.AttemptReleased),
        (traces.retried_before_first_delta, "replica_exited", "prefill", [], ev.UpstreamFailed),
    ],
)
def test_an_attempt_span_ends_when_the_log_says_the_attempt_ended(
    spans: Any,
    scenario: Callable[[str], traces.Trace],
    outcome: str,
    phase: str,
    fence_events: list[str],
    ended_by: type[ev.Event],
) -> None:
    trace = scenario("req_spans")
    feed(tracing.AttemptSpans(), trace)
    first = next(s for s in spans.get_finished_spans() if s.name == "attempt 1")
    assert (first.attributes["phasegate.outcome"], first.attributes["phasegate.phase"]) == (outcome, phase)
    assert [e.name for e in first.events if e.name in ("cancel_sent", "cancel_acked", "lease_expired")] == fence_events
    (ended,) = [e for e in trace.events if isinstance(e, ended_by) and e.attempt == 1]  # type: ignore[attr-defined]
    assert first.end_time == nanoseconds(ended.occurred_at)


def test_an_attempt_fenced_after_the_request_failed_keeps_its_span_until_released(spans: Any) -> None:
    trace = traces.stalled_in_decode("req_spans")
    attempt_spans, state = tracing.AttemptSpans(), RequestState(request_id=trace.request_id)
    finished_at_each = []
    for event in trace.events:
        state = apply(state, event)
        attempt_spans.recorded(state, event)
        finished_at_each.append((type(event), len(spans.get_finished_spans())))
    # the request ended with its terminal event; its attempt's span only once the fence released it
    kinds = [kind for kind, _ in finished_at_each]
    assert kinds.index(ev.RequestFailed) < kinds.index(ev.CancelAcked) < len(kinds) - 1
    assert kinds[-1] is ev.AttemptReleased
    assert [finished for _, finished in finished_at_each] == [0] * (len(kinds) - 1) + [1]
    (span,) = spans.get_finished_spans()
    assert span.attributes["phasegate.outcome"] == "cancel_acked"


def test_past_the_bound_the_oldest_requests_open_spans_end_untracked(spans: Any, monkeypatch: Any) -> None:
    monkeypatch.setattr(tracing, "MAX_TRACED_REQUESTS", 2)
    attempt_spans = tracing.AttemptSpans()
    for request_id in ("req_a", "req_b", "req_c"):  # each still decoding
        feed(attempt_spans, traces.in_flight(request_id))
    (evicted,) = spans.get_finished_spans()
    assert evicted.attributes["phasegate.request_id"] == "req_a"
    assert evicted.attributes["phasegate.outcome"] == "untracked"
