"""A null TCP relay: the floor a gateway is compared with. Bytes in, bytes out, nothing parsed.

    python -m ops.bench.relay --port P --upstream 127.0.0.1:Q

Each client connection gets one upstream connection; each side's bytes are written to
the other as they arrive (asyncio protocols, no buffering beyond the socket's).
"""

from __future__ import annotations

import argparse
import asyncio
import socket


class _Side(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self.pending: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is not None and peer.transport is not None:
            peer.transport.write(data)
        else:
            self.pending.append(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()


class _Client(_Side):
    def __init__(self, upstream: tuple[str, int]) -> None:
        super().__init__()
        self.upstream = upstream

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, upstream = await loop.create_connection(_Side, *self.upstream)
        except OSError:
            if self.transport is not None:
                self.transport.close()
            return
        upstream.peer, self.peer = self, upstream
        assert upstream.transport is not None
        for data in self.pending:
            upstream.transport.write(data)
        self.pending.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="HOST:PORT")
    options = parser.parse_args()
    host, _, port = options.upstream.rpartition(":")

    async def run() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _Client((host, int(port))), options.host, options.port, backlog=4096)
        async with server:
            await server.serve_forever()

    asyncio.run(run())


if __name__ == "__main__":
    main()
