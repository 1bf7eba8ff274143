"""OpenTelemetry at the HTTP layer, with the SDK's in-memory exporter and real requests.

A real gateway serves chats from a real sim worker and from an OpenAI-compatible upstream
(tests/support/scripted_upstream.py), each reached through a TCP proxy that keeps the
bytes the gateway sent. With tracing on, each generation request is one SERVER span
carrying its request id, the child of the client's W3C ``traceparent`` when it sent one,
and the replica received that span's ``traceparent``. With tracing off (the default)
no span is made and no ``traceparent`` leaves the gateway.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from app import tracing
from app.config import ReplicaConfig
from tests.support.gateway import MODEL, running_gateway
from tests.support.scripted_upstream import running_scripted_upstream
from tests.support.tcp_proxy import TcpProxy, tcp_proxy
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
        chat(gateway.url, {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"})
        gateway.settle()
    assert b"POST /v1/attempts" in bytes(proxy.forwarded) or proxy.forwarded  # the attempt went through
    assert sent_traceparents(proxy) == []
