"""The streamed answer's response (``app/api/token_stream.py``): the body through the
server's chunk writer, the deadline of a send that does not return, a client that leaves
while the stream waits, and pings while it waits."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from sse_starlette.sse import SendTimeoutError

from app.api.token_stream import TokenStreamResponse
from app.http.cycle import CHUNK_WRITER
from app.http.server import CLIENT_GONE


class Server:
    """What the ASGI server and Starlette's wrapped send saw."""

    def __init__(self, block_on: int | None = None) -> None:
        self.wrapped: list[Any] = []
        self.direct: list[bytes] = []
        self.block_on = block_on  # the body send that never returns (a client that stopped reading)
        self.leaves = asyncio.Event()  # set: receive() says the client left

    async def send(self, message: Any) -> None:
        self.wrapped.append(message)

    async def write(self, data: bytes) -> None:  # the server's chunk writer
        if len(self.direct) == self.block_on:
            await asyncio.Event().wait()
        self.direct.append(data)

    async def receive(self) -> Any:
        await self.leaves.wait()
        return {"type": "http.disconnect"}


async def serve(response: TokenStreamResponse, server: Server, scope: dict[str, Any] | None = None) -> None:
    scope = {} if scope is None else scope  # the caller's, filled in: what the response kept there
    scope.update({"type": "http", "method": "POST", CHUNK_WRITER: server})
    await response(scope, server.receive, server.send)


async def test_events_go_through_the_servers_writer_and_the_start_and_end_through_starlettes() -> None:
    async def body() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"
        await asyncio.sleep(0.15)  # a pause longer than the send deadline: no send is waiting
        yield b"data: 2\n\n"

    server = Server()
    await serve(TokenStreamResponse(body(), send_timeout=0.1, ping=0), server)
    assert server.direct == [b"data: 1\n\n", b"data: 2\n\n"]
    assert [m["type"] for m in server.wrapped] == ["http.response.start", "http.response.body"]
    assert server.wrapped[-1] == {"type": "http.response.body", "body": b"", "more_body": False}


async def test_a_send_that_does_not_return_ends_the_stream_after_the_deadline_and_cleans_up() -> None:
    closed = []

    async def body() -> AsyncIterator[bytes]:
        try:
            for n in range(100):
                yield b"data: %d\n\n" % n
        finally:
            closed.append(True)

    server = Server(block_on=2)
    began = time.monotonic()
    with pytest.raises(SendTimeoutError):
        await serve(TokenStreamResponse(body(), send_timeout=0.1, ping=0), server)
    assert 0.09 < time.monotonic() - began < 1.0
    assert server.direct == [b"data: 0\n\n", b"data: 1\n\n"] and closed == [True]
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


def waiting_body(cleanup: list[str]) -> AsyncIterator[bytes]:
    async def body() -> AsyncIterator[bytes]:
        try:
            yield b"data: 1\n\n"
            await asyncio.Event().wait()  # the next token never comes
            yield b"data: 2\n\n"
        except asyncio.CancelledError:
            cleanup.append("cancelled")
            raise
        finally:
            cleanup.append("closed")

    return body()


@pytest.mark.parametrize("how", ["server's future", "receive()"])
async def test_a_client_that_leaves_while_the_stream_waits_ends_it_at_once(how: str) -> None:
    """Told by the server's ``CLIENT_GONE`` future, or, under a server without one, by
    ``receive()``: the scope's future (which the body asks after each write) says the client
    left, the body cleans up, nothing more is sent (not even the end), and the response
    returns without a cancellation left over."""
    server, cleanup = Server(), []
    gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    scope: dict[str, Any] = {CLIENT_GONE: gone} if how == "server's future" else {}
    response = TokenStreamResponse(waiting_body(cleanup), ping=0)
    serving = asyncio.ensure_future(serve(response, server, scope))
    await asyncio.sleep(0.05)
    assert server.direct == [b"data: 1\n\n"] and not serving.done()
    if how == "server's future":
        gone.set_result(None)
    else:
        server.leaves.set()
    await asyncio.wait_for(serving, 1.0)
    assert scope[CLIENT_GONE].done() and cleanup == ["cancelled", "closed"]
    assert [m["type"] for m in server.wrapped] == ["http.response.start"]  # no end to a client gone
    assert serving.cancelling() == 0


async def test_a_stream_cancelled_from_outside_stays_cancelled() -> None:
    server, cleanup = Server(), []
    serving = asyncio.ensure_future(serve(TokenStreamResponse(waiting_body(cleanup), ping=0), server))
    await asyncio.sleep(0.05)
    serving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await serving
    assert cleanup == ["cancelled", "closed"]


async def test_pings_go_out_while_the_stream_waits_and_stop_with_it() -> None:
    server, cleanup = Server(), []
    gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    response = TokenStreamResponse(waiting_body(cleanup), ping=0.05)  # type: ignore[arg-type]
    serving = asyncio.ensure_future(serve(response, server, {CLIENT_GONE: gone}))
    await asyncio.sleep(0.28)
    pings = [data for data in server.direct if data.startswith(b": ping - ")]
    assert server.direct[0] == b"data: 1\n\n" and 4 <= len(pings) <= 6
    assert all(data.endswith(b"\n\n") for data in pings)
    gone.set_result(None)
    await asyncio.wait_for(serving, 1.0)
    sent = len(server.direct)
    await asyncio.sleep(0.12)
    assert len(server.direct) == sent  # no ping after the stream ended
