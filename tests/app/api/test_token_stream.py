"""The streamed answer's response (``app/api/token_stream.py``): the body through the
server's own send, and the deadline of a send that does not return."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from sse_starlette.sse import SendTimeoutError

from app.api.token_stream import SERVER_SEND, TokenStreamResponse


class Server:
    """What the ASGI server and Starlette's wrapped send saw."""

    def __init__(self, block_on: int | None = None) -> None:
        self.wrapped: list[Any] = []
        self.direct: list[bytes] = []
        self.block_on = block_on  # the body send that never returns (a client that stopped reading)

    async def send(self, message: Any) -> None:
        self.wrapped.append(message)

    async def server_send(self, message: Any) -> None:
        if len(self.direct) == self.block_on:
            await asyncio.Event().wait()
        self.direct.append(message["body"])

    async def receive(self) -> Any:
        await asyncio.Event().wait()  # the client never leaves


async def serve(response: TokenStreamResponse, server: Server) -> None:
    scope = {"type": "http", "method": "GET", SERVER_SEND: server.server_send}
    await response(scope, server.receive, server.send)


async def test_events_go_through_the_servers_send_and_the_start_and_end_through_starlettes() -> None:
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
