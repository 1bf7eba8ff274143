"""A TCP proxy under the test's control, to cut the network while both ends live.

The gateway reaches a replica through the proxy; ``blackhole()`` stops forwarding in
both directions without closing anything (bytes wait in the kernel's buffers, as on
a partitioned link), ``restore()`` lets them flow again. Connections opened while
blackholed are accepted and held. It runs on its own event loop in a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

from tests.support.loops import end_leftovers


class TcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._open: asyncio.Event | None = None
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.forwarded = bytearray()  # every byte sent on to the target, to read what a client sent
        self._cut_after: bytes | None = None  # blackhole_after's marker, until it is forwarded
        self.cut_made = threading.Event()  # blackhole_after's cut was made

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> TcpProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(10)
        return self

    async def _listen(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        assert self._open is not None
        accepting = asyncio.current_task()
        assert accepting is not None
        self._tasks.add(accepting)  # close() ends a connection still waiting for the cut to end
        try:
            await self._open.wait()
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
        except OSError:
            client_writer.close()
            return
        except asyncio.CancelledError:
            client_writer.close()
            raise
        finally:
            self._tasks.discard(accepting)
        for reader, writer, kept in ((client_reader, upstream_writer, True), (upstream_reader, client_writer, False)):
            task = asyncio.ensure_future(self._pump(reader, writer, kept))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, kept: bool = False) -> None:
        assert self._open is not None
        try:
            while True:
                await self._open.wait()
                data = await reader.read(65536)
                await self._open.wait()  # read before the cut: held, not forwarded
                if not data:
                    break
                if kept:
                    self.forwarded += data
                writer.write(data)
                if kept and self._cut_after is not None and self._cut_after in self.forwarded:
                    self._cut_after = None
                    self._open.clear()
                    self.cut_made.set()
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    def blackhole(self) -> None:
        self._loop.call_soon_threadsafe(self._set_open, False)

    def blackhole_after(self, marker: bytes) -> None:
        """Blackhole in the step that forwards ``marker`` to the target (a request that
        carries it reaches the target; nothing of its answer comes back), however late
        the caller's thread would have run."""
        self._cut_after = marker

    def restore(self) -> None:
        self._loop.call_soon_threadsafe(self._set_open, True)

    def _set_open(self, value: bool) -> None:
        assert self._open is not None
        if value:
            self._open.set()
        else:
            self._open.clear()

    def close(self) -> None:
        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await end_leftovers()  # a connection accepted as the server closed

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


@contextlib.contextmanager
def tcp_proxy(target_url: str) -> Iterator[TcpProxy]:
    host, port = target_url.removeprefix("http://").rsplit(":", 1)
    proxy = TcpProxy(host, int(port)).start()
    try:
        yield proxy
    finally:
        proxy.close()
