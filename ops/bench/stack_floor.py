"""The floor of phasegate's own stack: uvicorn's httptools server and Starlette, nothing else.

    python -m ops.bench.stack_floor --port P --upstream 127.0.0.1:Q

Where ``ops/bench/relay.py`` is the floor of any gateway (bytes in, bytes out), this is
the floor of a gateway written on the stack phasegate keeps: uvicorn's httptools protocol
and Starlette's routing, as phasegate's, the same way out for a streamed answer (a
response that writes through the ASGI ``send`` that Starlette's responses wrap), and no
work of its own. One route, ``POST /v1/chat/completions``:

- the request's body is read whole and sent as it came, on a kept-alive connection to
  the upstream (a pool of asyncio streams);
- the upstream's chunked answer goes to the client one HTTP chunk per upstream chunk
  (one SSE event each, from the fake upstream), each an ASGI body message; an answer
  that is not chunked gets a 502;
- nothing is parsed beyond HTTP's framing: no JSON, no tokens, no log, no state machine,
  no authentication, no limits.

What it costs per 1,000 tokens is what any gateway on this stack pays before it does
anything of its own, written the ordinary way; ``ops/bench/peers.py`` prints it beside
phasegate.

``--lean`` is the floor of phasegate's own way through the same stack: its server
(``app/http/server.py``: uvicorn's httptools protocol held to the HTTP limits) and each
upstream chunk written, from the upstream connection's ``data_received``, to the client
by the server's ``ChunkWriter`` (``app/http/cycle.py``), no ASGI message a chunk and no
task woken while the client keeps up: as phasegate's token tap writes a caught-up
client's events. The request's way in, the response's start and its end still go
through Starlette.
"""

from __future__ import annotations

import argparse
import asyncio

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from app.http.cycle import CHUNK_WRITER, ChunkWriter
from app.http.server import HttpLimits, server_config

Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


def chat_request(host: str, port: int, body: bytes) -> bytes:
    """The upstream request that carries a client's chat request ``body`` as it came."""
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: %s:%d\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (host.encode(), port, len(body), body)
    )


def chunked(head: bytes) -> bool:
    return b"transfer-encoding: chunked" in head.lower()


def not_chunked() -> Response:
    return JSONResponse({"error": "the floor forwards chunked answers only"}, status_code=502)


class Upstream:
    """Kept-alive asyncio streams to one upstream."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.idle: list[Stream] = []

    async def answer(self, body: bytes) -> Response:
        """Send the chat request; the response that forwards its answer."""
        stream = self.idle.pop() if self.idle else await asyncio.open_connection(self.host, self.port)
        reader, writer = stream
        writer.write(chat_request(self.host, self.port, body))
        head = await reader.readuntil(b"\r\n\r\n")
        if not chunked(head):
            writer.close()
            return not_chunked()
        return Forward(self, stream, int(head.split(b" ", 2)[1]))


class Forward(Response):
    """The upstream's answer, chunk by chunk, through the ASGI ``send`` (as phasegate's
    token stream goes out: a response of its own, not a body iterator)."""

    def __init__(self, upstream: Upstream, stream: Stream, status: int) -> None:
        self.upstream, self.stream, self.status_code = upstream, stream, status
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        reader, writer = self.stream
        await send({"type": "http.response.start", "status": self.status_code, "headers": SSE_HEADERS})
        try:
            while True:
                size = int((await reader.readline()).split(b";", 1)[0], 16)
                if size == 0:
                    await reader.readline()  # the empty trailer
                    break
                data = await reader.readexactly(size + 2)
                await send({"type": "http.response.body", "body": data[:-2], "more_body": True})
        except BaseException:
            writer.close()  # mid-answer: the connection cannot be used again
            raise
        self.upstream.idle.append(self.stream)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class LeanConnection(asyncio.Protocol):
    """A kept-alive upstream connection whose chunked answer goes to the client as it is
    read: each whole chunk written by the client's ``ChunkWriter`` in ``data_received``,
    kept for the response's task only while the client's socket is full.

    Its framing is taken off here, not by phasegate's ``Chunks``
    (``app/replicas/chunked.py``), which also reads chunks split across reads, trailers
    and extensions into a ``bytearray``: the floor is the least this path can cost, and
    with ``Chunks`` it cost 0.027-0.031 against 0.022 s per 1,000 tokens (two runs)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.head: asyncio.Future[bytes] | None = None
        self.sink: ChunkWriter | None = None
        self.pending: list[bytes] = []
        self.waiter: asyncio.Future[None] | None = None
        self.done = self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def send(self, request: bytes) -> asyncio.Future[bytes]:
        """Write a request; the future of its answer's head."""
        assert self.transport is not None
        self.buffer, self.sink, self.pending, self.done = b"", None, [], False
        self.head = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self.head

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.head is not None and not self.head.done():
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            self.head.set_result(self.buffer[:end])
            self.buffer = self.buffer[end + 4 :]
        self.forward()

    def forward(self) -> None:
        """Write (or keep) every whole chunk read, once the response started."""
        sink = self.sink
        if sink is None:
            return
        buffer, at = self.buffer, 0
        while (line_end := buffer.find(b"\r\n", at)) >= 0:
            size = int(buffer[at:line_end].split(b";", 1)[0], 16)
            end = line_end + 2 + size
            if len(buffer) < end + 2:
                break
            at = end + 2
            if size == 0:
                self.done = True
                break
            data = buffer[line_end + 2 : end]
            if self.pending or not sink.write_now(data):
                self.pending.append(data)
        self.buffer = buffer[at:]
        self.wake()

    def wake(self) -> None:
        if (self.pending or self.done) and self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.done = self.lost = True
        if self.head is not None and not self.head.done():
            self.head.set_exception(ConnectionError("the upstream closed"))
        self.wake()


class LeanUpstream:
    """Kept-alive :class:`LeanConnection`\\ s to one upstream."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.idle: list[LeanConnection] = []

    async def answer(self, body: bytes) -> Response:
        """Send the chat request; the response that forwards its answer."""
        if self.idle:
            connection = self.idle.pop()
        else:
            _, connection = await asyncio.get_running_loop().create_connection(LeanConnection, self.host, self.port)
        head = await connection.send(chat_request(self.host, self.port, body))
        if not chunked(head):
            assert connection.transport is not None
            connection.transport.close()
            return not_chunked()
        return LeanForward(self, connection, int(head.split(b" ", 2)[1]))


class LeanForward(Response):
    """The upstream's chunks written from its connection's callback (see the module's
    docstring); this task starts and ends the response, and writes what the client's
    full socket held back."""

    def __init__(self, upstream: LeanUpstream, connection: LeanConnection, status: int) -> None:
        self.upstream, self.connection, self.status_code = upstream, connection, status
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        connection, loop = self.connection, asyncio.get_running_loop()
        await send({"type": "http.response.start", "status": self.status_code, "headers": SSE_HEADERS})
        sink = connection.sink = scope[CHUNK_WRITER]
        connection.forward()  # what came with the head
        try:
            while True:
                while connection.pending:
                    await sink.write(connection.pending.pop(0))
                if connection.done:
                    break
                connection.waiter = loop.create_future()
                await connection.waiter
        except BaseException:
            if connection.transport is not None:
                connection.transport.close()
            raise
        if not connection.lost:
            self.upstream.idle.append(connection)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def application(upstream: Upstream | LeanUpstream) -> Starlette:
    async def chat(request: Request) -> Response:
        return await upstream.answer(await request.body())

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="HOST:PORT")
    parser.add_argument("--lean", action="store_true", help="phasegate's server, chunks written from the callback")
    options = parser.parse_args()
    host, _, port = options.upstream.rpartition(":")
    where = dict(host=options.host, port=options.port, loop="asyncio", log_level="warning", access_log=False)
    if options.lean:
        config = server_config(application(LeanUpstream(host, int(port))), HttpLimits(), backlog=4096, **where)
    else:
        config = uvicorn.Config(application(Upstream(host, int(port))), http="httptools", backlog=4096, **where)
    uvicorn.Server(config).run()


if __name__ == "__main__":
    main()
