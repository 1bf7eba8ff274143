"""The floor of phasegate's own stack: uvicorn's httptools server and Starlette, nothing else.

    python -m ops.bench.stack_floor --port P --upstream 127.0.0.1:Q

Where ``ops/bench/relay.py`` is the floor of any gateway (bytes in, bytes out), this is
the floor of a gateway written on the stack issue 12 keeps: the same server protocol and
the same Starlette routing as phasegate, the same way out for a streamed answer (a
response that writes through the ASGI ``send`` that Starlette's responses wrap), and no
work of its own. One route, ``POST /v1/chat/completions``:

- the request's body is read whole and sent as it came, on a kept-alive connection to
  the upstream (a pool of asyncio streams);
- the upstream's chunked answer goes to the client one HTTP chunk per upstream chunk
  (one SSE event each, from the fake upstream), each an ASGI body message;
- nothing is parsed beyond HTTP's framing: no JSON, no tokens, no log, no state machine,
  no authentication, no limits.

What it costs per 1,000 tokens is what any gateway on this stack pays before it does
anything of its own; ``ops/bench/peers.py`` prints it beside phasegate.
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

Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class Upstream:
    """Kept-alive connections to one upstream, and one request's exchange on them."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.idle: list[Stream] = []

    async def open(self, body: bytes) -> tuple[Stream, int, bytes]:
        """Send the chat request: the connection, the answer's status and the rest of its head."""
        stream = self.idle.pop() if self.idle else await asyncio.open_connection(self.host, self.port)
        reader, writer = stream
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: %s:%d\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (self.host.encode(), self.port, len(body), body)
        )
        head = await reader.readuntil(b"\r\n\r\n")
        return stream, int(head.split(b" ", 2)[1]), head

    async def whole_body(self, stream: Stream, head: bytes) -> bytes | None:
        """A whole (content-length) answer's body, or None for a chunked one."""
        for line in head.lower().split(b"\r\n"):
            if line.startswith(b"content-length:"):
                return await stream[0].readexactly(int(line.split(b":", 1)[1]))
        return None

    def release(self, stream: Stream) -> None:
        self.idle.append(stream)


class Forward(Response):
    """The upstream's answer, chunk by chunk, through the ASGI ``send`` (as phasegate's
    token stream goes out: a response of its own, not a body iterator)."""

    def __init__(self, upstream: Upstream, stream: Stream, status: int) -> None:
        self.upstream, self.stream, self.status_code = upstream, stream, status
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        reader, writer = self.stream
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": self.status_code, "headers": headers})
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
        self.upstream.release(self.stream)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def application(upstream: Upstream) -> Starlette:
    async def chat(request: Request) -> Response:
        body = await request.body()
        stream, status, head = await upstream.open(body)
        whole = await upstream.whole_body(stream, head)
        if whole is not None:
            upstream.release(stream)
            return Response(whole, status_code=status, media_type="application/json")
        return Forward(upstream, stream, status)

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/health", health)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="HOST:PORT")
    options = parser.parse_args()
    host, _, port = options.upstream.rpartition(":")
    app = application(Upstream(host, int(port)))
    uvicorn.run(
        app,
        host=options.host,
        port=options.port,
        http="httptools",
        loop="asyncio",
        log_level="warning",
        access_log=False,
        backlog=4096,
    )


if __name__ == "__main__":
    main()
