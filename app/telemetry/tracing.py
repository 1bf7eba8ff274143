"""OpenTelemetry traces: a span per generation request, its context sent on to the replicas.

Off unless configured (``otel_endpoint``; the ``otel`` extra installs the SDK and the
OTLP exporter): with it unset nothing of OpenTelemetry is imported and every hook here
returns at once.

How this works: :class:`RequestSpans`, an ASGI middleware, opens a SERVER span for each
``POST /v1/chat/completions`` and ``/v1/completions`` (the child of an incoming W3C
``traceparent``, if the client sent one) and makes it current for the whole exchange,
streamed body included; the response's ``x-request-id`` and status become its
attributes. Every task the request starts inherits that context, so
:func:`inject_traceparent`, an httpx request hook of the replica clients, sends the
request span's ``traceparent`` to workers and OpenAI upstreams (a replica's lease
renewals, shared by its requests, start :func:`without_span`).

:class:`AttemptSpans` is the driver's tracing hook (``app.driver.context.Tracing``; the
driver never imports OpenTelemetry). It gives ``RequestAccepted`` the request span's
trace id and, from the events the driver records, makes a child span per attempt:
opened by ``AttemptStarted``, with the request id, replica and lease epoch; span events
for the commit point, the fence, the cancel sent and acknowledged, a lapsed lease and an
upstream failure; ended when the log says the attempt ended (completed, released, known
dead), with that outcome and the request's phase then. The times are the events' own.
"""

from __future__ import annotations

import contextvars
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx

from statemachine import events as ev
from statemachine.phases import Phase
from statemachine.request_state import RequestState

log = logging.getLogger("phasegate.tracing")

GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")

_tracer: Any = None  # an opentelemetry Tracer while tracing is on


class TracingUnavailable(RuntimeError):
    """Tracing is configured but OpenTelemetry is not installed."""


def configure(endpoint: str, service_name: str = "phasegate") -> None:
    """Export spans over OTLP/HTTP to ``endpoint`` (e.g. ``http://collector:4318/v1/traces``)."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        raise TracingUnavailable(
            "otel_endpoint is set but the otel extra is not installed: pip install 'phasegate[otel]'"
        ) from None
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    install(provider)


def install(provider: Any) -> None:
    """Trace with ``provider`` (an SDK ``TracerProvider``; tests give one with an in-memory exporter)."""
    global _tracer
    _tracer = provider.get_tracer("phasegate")


def uninstall() -> None:
    global _tracer
    _tracer = None


def without_span(context: contextvars.Context) -> contextvars.Context:
    """``context`` with no current span: for a task that serves many requests (lease renewals)."""
    if _tracer is not None:
        from opentelemetry import context as otel_context

        context.run(otel_context.attach, otel_context.Context())
    return context


async def inject_traceparent(request: httpx.Request) -> None:
    """httpx request hook: the current span's W3C ``traceparent`` on a call to a replica."""
    request.headers.update(trace_headers())


def trace_headers() -> dict[str, str]:
    """The current span's W3C ``traceparent`` as headers for a call to a replica (none
    while tracing is off): for a request written without httpx (app/replicas/upstream_http.py)."""
    carrier: dict[str, str] = {}
    if _tracer is not None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        TraceContextTextMapPropagator().inject(carrier)
    return carrier


Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Any]]
Send = Callable[[Any], Awaitable[None]]


class RequestSpans:
    """ASGI middleware: one span per generation request, current while it is served."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tracer = _tracer
        if tracer is None or scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        incoming = {key.decode("latin-1"): value.decode("latin-1") for key, value in scope["headers"]}
        parent = TraceContextTextMapPropagator().extract(incoming)
        name = f"{scope['method']} {scope['path']}"
        with tracer.start_as_current_span(name, context=parent, kind=SpanKind.SERVER) as span:
            span.set_attribute("http.request.method", scope["method"])
            span.set_attribute("url.path", scope["path"])

            async def sending(message: Any) -> None:
                if message["type"] == "http.response.start":
                    status = int(message["status"])
                    span.set_attribute("http.response.status_code", status)
                    for key, value in message.get("headers", []):
                        if key.lower() == b"x-request-id":
                            span.set_attribute("phasegate.request_id", value.decode("latin-1"))
                    if status >= 500:
                        span.set_status(Status(StatusCode.ERROR))
                await send(message)

            await self.app(scope, receive, sending)


# --- spans per attempt ---------------------------------------------------------------

# Span events for what the log records of an attempt: the event's name on the span, and
# the body fields it carries along.
_ATTEMPT_EVENTS: dict[type[ev.Event], tuple[str, tuple[str, ...]]] = {
    ev.FirstTokenReceived: ("first_token_received", ()),
    ev.FirstDeltaCommitted: ("first_delta_committed", ()),
    ev.UpstreamFailed: ("upstream_failed", ("kind", "detail")),
    ev.AttemptFenced: ("fenced", ("waiting_for",)),
    ev.CancelSent: ("cancel_sent", ()),
    ev.CancelAcked: ("cancel_acked", ("generated_tokens",)),
    ev.LeaseExpired: ("lease_expired", ()),
}

MAX_TRACED_REQUESTS = 10_000  # past it the oldest request's open spans end ("untracked")


@dataclass(slots=True)
class _TracedRequest:
    parent: Any  # the OpenTelemetry context the request was accepted in (its span current)
    attempts: dict[int, Any] = field(default_factory=dict)  # open spans, by attempt


def _nanoseconds(at: datetime) -> int:
    return int(at.timestamp() * 1e9)


class AttemptSpans:
    """The driver's tracing hook: a span per attempt under the request's span."""

    def __init__(self) -> None:
        self._requests: OrderedDict[str, _TracedRequest] = OrderedDict()

    def trace_id(self) -> str | None:
        if _tracer is None:
            return None
        from opentelemetry import trace

        context = trace.get_current_span().get_span_context()
        return format(context.trace_id, "032x") if context.is_valid else None

    def recorded(self, state: RequestState, event: ev.Event) -> None:
        if _tracer is None:
            return
        try:
            self._recorded(_tracer, state, event)
        except Exception:  # a trace must never fail a request
            log.exception("tracing request %s failed at %s", event.request_id, type(event).__name__)

    def _recorded(self, tracer: Any, state: RequestState, event: ev.Event) -> None:
        if isinstance(event, ev.RequestAccepted):
            from opentelemetry import context as otel_context

            self._requests[event.request_id] = _TracedRequest(otel_context.get_current())
            while len(self._requests) > MAX_TRACED_REQUESTS:
                _, oldest = self._requests.popitem(last=False)
                for span in oldest.attempts.values():
                    span.set_attribute("phasegate.outcome", "untracked")
                    span.end()
            return
        traced = self._requests.get(event.request_id)
        if traced is None:  # accepted before tracing began, or by another instance
            return
        if isinstance(event, ev.AttemptStarted):
            from opentelemetry.trace import SpanKind

            traced.attempts[event.attempt] = tracer.start_span(
                f"attempt {event.attempt}",
                context=traced.parent,
                kind=SpanKind.CLIENT,
                start_time=_nanoseconds(event.occurred_at),
                attributes={
                    "phasegate.request_id": event.request_id,
                    "phasegate.attempt": event.attempt,
                    "phasegate.replica": event.replica_id,
                    "phasegate.lease_epoch": event.lease_epoch,
                },
            )
        described = _ATTEMPT_EVENTS.get(type(event))
        if described is not None and isinstance(event, ev.AttemptScoped) and event.attempt in traced.attempts:
            name, fields = described
            attributes = {f"phasegate.{body_field}": str(getattr(event, body_field)) for body_field in fields}
            traced.attempts[event.attempt].add_event(name, attributes, timestamp=_nanoseconds(event.occurred_at))
        self._settle(traced, state, event)
        if state.phase is Phase.TERMINATED and not traced.attempts:
            del self._requests[event.request_id]

    def _settle(self, traced: _TracedRequest, state: RequestState, event: ev.Event) -> None:
        """Note the request's phase on the live attempt's span (what it ends with is the
        phase it last ran in); end the spans of attempts the log says ended."""
        from opentelemetry.trace import Status, StatusCode

        current = state.current_attempt
        for number, span in list(traced.attempts.items()):
            attempt = state.attempt(number)
            if attempt is None:
                continue
            if attempt.ended is None:
                if attempt is current and state.phase is not Phase.TERMINATED:
                    span.set_attribute("phasegate.phase", state.phase.value)
                continue
            span.set_attribute("phasegate.outcome", attempt.ended)
            if attempt.failure is not None:
                span.set_status(Status(StatusCode.ERROR, f"{attempt.failure.value}: {attempt.failure_detail}"))
            span.end(end_time=_nanoseconds(event.occurred_at))
            del traced.attempts[number]
