"""A streamed answer's response on the real server (``app/http/server.py``'s protocol, a
real socket): its chunks framed by the server's ``ChunkWriter`` as HTTP/1.1 chunks, an
HTTP/1.0 client's body delimited by the close instead, a HEAD answered without a body,
a client that leaves mid-stream noticed through ``CLIENT_GONE`` while the stream waits
for its next event, a pipelined request's head not cut by the header timeout while the
answer before it streams, and no byte of the response, head included, before the body's
first events are ready (a stream waits there for its commit point, and may be refused)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import h11
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from app.api.token_stream import Refused, TokenStreamResponse
from app.http.cycle import CHUNK_WRITER
from app.http.server import CLIENT_GONE, HttpLimits, server_config
from ops.processes import listening_socket

EVENTS = [b'id: 0\ndata: {"n":0}\n\n', b'id: 1\ndata: {"n":1}\n\n', b"data: [DONE]\n\n"]


class Stream:
    """The app's side: what it sent, whether the client left, and the body's cleanup."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []  # what the server wrote to the socket, write by write
        self.ready = asyncio.Event()  # unset: the stream waits before its first event
        self.ready.set()
        self.refuse = False  # the body refuses the stream before its first event
        self.hold = asyncio.Event()  # unset: the stream waits after its first event
        self.hold.set()
        self.cleaned = asyncio.Event()
        self.server_gone: asyncio.Future[None] | None = None  # the server's CLIENT_GONE of the request

    async def body(self) -> AsyncIterator[bytes]:
        try:
            await self.ready.wait()
            if self.refuse:
                raise Refused(JSONResponse({"error": {"code": "refused"}}, status_code=503))
            yield EVENTS[0]
            await self.hold.wait()
            for event in EVENTS[1:]:
                yield event
        finally:
            self.cleaned.set()

    async def endpoint(self, request: Request) -> Response:
        self.server_gone = request.scope[CLIENT_GONE]
        transport = request.scope[CHUNK_WRITER].cycle.transport
        write = transport.write

        def counted(data: bytes) -> None:
            self.writes.append(bytes(data))
            write(data)

        transport.write = counted
        return TokenStreamResponse(self.body(), ping=0)

    async def late_body(self, request: Request) -> Response:
        """A chunked response that starts, then waits before its first chunk."""

        async def body() -> AsyncIterator[bytes]:
            await self.hold.wait()
            yield EVENTS[0]

        return StreamingResponse(body())


@contextlib.asynccontextmanager
async def serving(limits: HttpLimits) -> AsyncIterator[tuple[int, Stream]]:
    stream = Stream()
    routes = [Route("/stream", stream.endpoint, methods=["GET", "POST"]), Route("/late", stream.late_body)]
    app = Starlette(routes=routes)
    listener = listening_socket()
    port = listener.getsockname()[1]
    server = uvicorn.Server(server_config(app, limits, host="127.0.0.1", port=port, log_level="warning"))
    serving = asyncio.ensure_future(server.serve(sockets=[listener]))
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield port, stream
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 10)
        listener.close()


@pytest.fixture
async def served() -> AsyncIterator[tuple[int, Stream]]:
    async with serving(HttpLimits()) as served:
        yield served


def exchange(port: int, request: bytes) -> bytes:
    """Send ``request`` and read until the server closes or the response ends."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(request)
        received = b""
        while not received.endswith(b"0\r\n\r\n"):
            data = sock.recv(65536)
            if not data:
                break
            received += data
        return received


def received_until(sock: socket.socket, wanted: bytes) -> bytes:
    """What ``sock`` received until ``wanted`` was in it, or the server closed (each
    ``recv`` brings what one or more of the server's writes sent)."""
    received = b""
    while wanted not in received:
        data = sock.recv(65536)
        if not data:
            break
        received += data
    return received


def parsed(received: bytes) -> tuple[h11.Response, bytes, bool]:
    """The response, its body and whether it ended, as h11's client reads them."""
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method="GET", target="/stream", headers=[("host", "x")]))
    client.send(h11.EndOfMessage())
    client.receive_data(received)
    head, body, ended = None, b"", False
    for event in iter(client.next_event, h11.NEED_DATA):
        if isinstance(event, h11.Response):
            head = event
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            ended = True
            break
    assert head is not None
    return head, body, ended


async def test_http11_chunks_are_framed_by_the_servers_writer(served: tuple[int, Stream]) -> None:
    port, _ = served
    received = await asyncio.to_thread(exchange, port, b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
    head, body, ended = parsed(received)
    assert head.status_code == 200 and dict(head.headers)[b"transfer-encoding"] == b"chunked"
    assert body == b"".join(EVENTS) and ended
    # one chunk an event, as written: the size line, the event, CRLF
    assert b"%x\r\n%b\r\n" % (len(EVENTS[1]), EVENTS[1]) in received


async def test_an_http10_body_is_delimited_by_the_close(served: tuple[int, Stream]) -> None:
    port, _ = served
    received = await asyncio.to_thread(exchange, port, b"GET /stream HTTP/1.0\r\n\r\n")
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding" not in head.lower()
    assert body == b"".join(EVENTS)


async def test_a_head_request_gets_the_head_alone(served: tuple[int, Stream]) -> None:
    port, _ = served
    received = await asyncio.to_thread(exchange, port, b"HEAD /stream HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    assert received.startswith(b"HTTP/1.1 200") and received.endswith(b"\r\n\r\n")
    assert b"data:" not in received


async def test_a_client_that_leaves_while_the_stream_waits_is_noticed_at_once(served: tuple[int, Stream]) -> None:
    port, stream = served
    stream.hold.clear()  # the stream waits after its first event, sending nothing
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    with contextlib.closing(sock):
        sock.sendall(b"POST /stream HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
        first = await asyncio.to_thread(received_until, sock, EVENTS[0])
        assert EVENTS[0] in first
    assert stream.server_gone is not None
    await asyncio.wait_for(asyncio.shield(stream.server_gone), 5)  # told by the server's CLIENT_GONE, not by a send
    await asyncio.wait_for(stream.cleaned.wait(), 5)
    assert stream.server_gone is not None and stream.server_gone.done()


async def test_a_pipelined_head_does_not_time_out_while_the_response_before_it_streams() -> None:
    """The header deadline waits while the application answers: the next request's head,
    sent early and in part, is not cut by the header timeout before that answer ends."""
    header_s = 0.3
    async with serving(HttpLimits(header_timeout_s=header_s)) as (port, stream):
        stream.hold.clear()  # the stream waits after its first event
        request = b"POST /stream HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n"
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        with contextlib.closing(sock):
            sock.sendall(request)
            assert EVENTS[0] in await asyncio.to_thread(received_until, sock, EVENTS[0])
            sock.sendall(request[:20])  # part of the next request's head
            await asyncio.sleep(header_s * 4)
            stream.hold.set()
            first = await asyncio.to_thread(received_until, sock, b"0\r\n\r\n")
            assert first.endswith(EVENTS[-1] + b"\r\n0\r\n\r\n")  # the whole first answer
            stream.hold.clear()
            sock.sendall(request[20:])
            second = await asyncio.to_thread(received_until, sock, EVENTS[0])
        assert second.startswith(b"HTTP/1.1 200 ") and EVENTS[0] in second


async def test_nothing_goes_out_before_the_bodys_first_events_not_even_the_head(served: tuple[int, Stream]) -> None:
    port, stream = served
    stream.ready.clear()  # as a stream whose commit point is not durable yet
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    with contextlib.closing(sock):
        sock.sendall(b"POST /stream HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
        await asyncio.sleep(0.3)
        sock.setblocking(False)
        with pytest.raises(BlockingIOError):
            sock.recv(65536)  # not one byte yet
        sock.setblocking(True)
        stream.ready.set()
        received = await asyncio.to_thread(received_until, sock, b"0\r\n\r\n")
    head, body, ended = parsed(received)
    assert head.status_code == 200 and body == b"".join(EVENTS) and ended


async def test_a_body_that_refuses_the_stream_gets_its_answer_sent_instead(served: tuple[int, Stream]) -> None:
    port, stream = served
    stream.refuse = True
    received = await asyncio.to_thread(
        exchange, port, b"POST /stream HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
    )
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 ") and b"text/event-stream" not in head
    assert body == b'{"error":{"code":"refused"}}'
    await asyncio.wait_for(stream.cleaned.wait(), 5)


async def test_the_head_goes_out_in_one_write_with_the_first_events(served: tuple[int, Stream]) -> None:
    port, stream = served
    received = await asyncio.to_thread(exchange, port, b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
    assert parsed(received)[1] == b"".join(EVENTS)
    first = stream.writes[0]
    assert first.startswith(b"HTTP/1.1 200 ") and first.endswith(b"%x\r\n%b\r\n" % (len(EVENTS[0]), EVENTS[0]))


async def test_a_head_with_no_chunk_behind_it_goes_out_at_once(served: tuple[int, Stream]) -> None:
    port, stream = served
    stream.hold.clear()  # the body waits before its first chunk
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    with contextlib.closing(sock):
        sock.sendall(b"GET /late HTTP/1.1\r\nhost: x\r\n\r\n")
        head = await asyncio.to_thread(received_until, sock, b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ") and head.endswith(b"\r\n\r\n")  # the head alone
        stream.hold.set()
        rest = await asyncio.to_thread(received_until, sock, b"0\r\n\r\n")
    assert parsed(head + rest)[1:] == (EVENTS[0], True)
