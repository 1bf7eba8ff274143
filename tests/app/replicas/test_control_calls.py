"""A control call (renew, cancel) whose connection breaks under it, over real sockets.

A raw peer reads each request whole and then closes or resets its connection without an
answer, for as many calls as it is told to; after that it answers as a worker would. The
client sends a broken call once more (every control call is safe twice), and only a call
broken twice is a :class:`StreamBroken`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
from collections.abc import AsyncIterator

import pytest

from app.replicas.worker_client import CancelAck, WorkerClient
from app.replicas.worker_errors import StreamBroken

ACK = {"state": "aborted", "generated_tokens": 7, "stop": "cancelled"}


@contextlib.asynccontextmanager
async def breaking_peer(breaks: int, *, reset: bool) -> AsyncIterator[tuple[str, list[dict[str, object]]]]:
    """A peer whose first ``breaks`` calls lose their connection after the request was read
    (closed, or reset with ``reset``), and whose later calls are answered with ``ACK``;
    yields its URL and the bodies of the calls it read, in order."""
    calls: list[dict[str, object]] = []
    handlers: list[asyncio.Task[None]] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handlers.append(asyncio.current_task())  # type: ignore[arg-type]
        try:
            while True:  # the calls of one kept-alive connection
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                calls.append(json.loads(await reader.readexactly(length)))
                if len(calls) <= breaks:
                    if reset:
                        sock = writer.get_extra_info("socket")
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    return
                body = json.dumps(ACK).encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                    % (len(body), body)
                )
                await writer.drain()
        except asyncio.IncompleteReadError:
            return  # the client closed its connection
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", calls
    finally:
        server.close()
        await asyncio.gather(*handlers, return_exceptions=True)
        await server.wait_closed()


@pytest.mark.parametrize("reset", [False, True], ids=["closed", "reset"])
async def test_a_cancel_whose_connection_broke_is_sent_once_more_and_answered(reset: bool):
    async with breaking_peer(1, reset=reset) as (url, calls):
        client = WorkerClient(url)
        try:
            ack = await client.cancel("r", 1, 3)
        finally:
            await client.aclose()
    assert ack == CancelAck("aborted", 7, "cancelled")
    sent = {"request_id": "r", "attempt": 1, "lease_epoch": 3}
    assert calls == [sent, sent]


@pytest.mark.parametrize("reset", [False, True], ids=["closed", "reset"])
async def test_a_call_broken_twice_is_a_broken_stream(reset: bool):
    async with breaking_peer(2, reset=reset) as (url, calls):
        client = WorkerClient(url)
        try:
            with pytest.raises(StreamBroken) as broken:
                await client.renew("r", 1, 3, 5.0)
            assert "/v1/attempts/renew" in str(broken.value)
            assert len(calls) == 2  # sent once more, not more
            assert await client.cancel("r", 1, 3) == CancelAck("aborted", 7, "cancelled")  # the peer answers again
        finally:
            await client.aclose()
    assert len(calls) == 3
