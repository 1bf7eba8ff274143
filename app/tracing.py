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
renewals, shared by its requests, start :func:`without_span`). Spans per attempt
(replica, lease epoch, outcome) need hooks in the driver and are not made here.
"""

from __future__ import annotations

import contextvars
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import httpx

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
    if _tracer is None:
        return
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    TraceContextTextMapPropagator().inject(request.headers)


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
