"""The gateway's listening sockets hand asyncio connections it sets TCP_NODELAY on.

asyncio sets TCP_NODELAY only on an accepted socket that says it is TCP, and a socket
accepted from a listener made with protocol 0 says 0: Nagle then held a stream's first
event behind its response head until the client's delayed ACK (+40 ms to the time to
first token of ``phasegate serve --processes 1``). Each listener here serves one real
connection, and the server side of it is asked.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import pytest

from app.process.gateway_process import Listening, _own_socket
from app.process.serve import _bind


def rebuilt_from_its_descriptor(host: str) -> socket.socket:
    """A child of ``--processes N``: the parent's listener, from its file descriptor."""
    parent = _bind(host, 0)
    return Listening(fileno=parent.detach())


@pytest.mark.parametrize(
    "listener",
    [lambda host: _bind(host, 0), _own_socket, rebuilt_from_its_descriptor],
    ids=["serve, one process", "a process with its own socket", "a process of --processes N"],
)
async def test_accepted_connections_send_small_writes_at_once(listener: Callable[[str], socket.socket]) -> None:
    sock = listener("127.0.0.1")
    nodelay: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nodelay.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(serve, sock=sock)
    try:
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        assert await asyncio.wait_for(nodelay, 5) != 0
        writer.close()
    finally:
        server.close()
        await server.wait_closed()
