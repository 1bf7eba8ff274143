"""A TCP proxy that breaks the first connection when the answer starts, before the
client sees a response header (as a load balancer or a phone's network dropping it);
later connections pass through. It runs on its own event loop in a thread."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from tests.support.loops import end_leftovers


class CutBeforeHeaders:
    """A TCP proxy in front of the gateway that breaks the first connection when the
    gateway's answer starts: the client never sees a response header."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.connections = 0
        self.cut = threading.Event()
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    def __enter__(self) -> CutBeforeHeaders:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
                await self._server.wait_closed()
            for writer in self._writers:
                writer.transport.abort()
            await end_leftovers()  # and a connection accepted as the server closed

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        cut_this = self.connections == 1
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers += [writer, up_writer]

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, *, answer: bool) -> None:
            with contextlib.suppress(ConnectionError, OSError):
                while data := await src.read(65536):
                    if answer and cut_this:  # the answer starts: break both sides, forward nothing
                        self.cut.set()
                        for side in (writer, up_writer):
                            side.transport.abort()
                        return
                    dst.write(data)
                    await dst.drain()
            with contextlib.suppress(Exception):
                dst.close()

        await asyncio.gather(pump(reader, up_writer, answer=False), pump(up_reader, writer, answer=True))
