"""HTTP/1.1 for the hot request of an OpenAI upstream (a streamed completion), lean.

How this works: httpx builds the request (the client's headers, its hooks) and reads
the answer as an ``httpx.Response``, as before; in between, this module sends it on
a kept-alive connection of its own and hands the body over as it is read. httpx's
own transport put five async generators, an anyio cancel scope and h11 between each
chunk of the body and the gateway, and its pool closed every connection whose body
ended unread, so each attempt paid for a new TCP connection too. Here one socket read
is one body read, however many chunks it holds (the tokens that piled up while the
gateway was busy come together), framed by h11.

A connection goes back to the idle list only once its body was read to its end;
closed before that (a cancel, a fence: closing is how vLLM aborts) it is closed. An
idle connection is used again only while it is younger than ``IDLE_S`` and its server
has not closed it, so a request is never sent on a connection its server dropped
(servers time idle connections out: uvicorn after 5 s). Errors are httpx's own
(``ConnectError``, ``ConnectTimeout``, ``ReadError``, ``RemoteProtocolError``,
``WriteError``), so a caller maps them as it mapped httpx's. Only ``http://`` without
a proxy from the environment comes here; anything else stays with httpx
(:func:`lean_connections`).
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import AsyncIterator

import h11
import httpx

IDLE_S = 2.0  # an idle connection older than this is closed rather than used again
READ_BYTES = 65536


class Connections:
    """The kept-alive connections to one ``host:port``."""

    def __init__(self, host: str, port: int, *, connect_timeout_s: float) -> None:
        self.host, self.port = host, port
        self.connect_timeout_s = connect_timeout_s
        self._idle: list[tuple[float, _Connection]] = []

    async def send(self, request: httpx.Request) -> httpx.Response:
        """Send ``request`` (its body already read) and return once the answer's head came."""
        connection = self._take_idle() or await self._connect()
        try:
            head = await connection.exchange(request)
        except BaseException:
            connection.close()
            raise
        headers = [(name, value) for name, value in head.headers]
        chunks = None
        if any(name == b"transfer-encoding" and b"chunked" in value.lower() for name, value in headers):
            chunks = _Chunks(connection.h11.trailing_data[0])  # the body's bytes h11 read with the head
        closes = any(name == b"connection" and b"close" in value.lower() for name, value in headers)
        stream = _Body(connection, self, chunks, keep_alive=head.http_version == b"1.1" and not closes)
        return httpx.Response(head.status_code, headers=headers, stream=stream, request=request)

    def _take_idle(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            since, connection = self._idle.pop()
            if now - since < IDLE_S and connection.reusable():
                return connection
            connection.close()
        return None

    def give_back(self, connection: _Connection) -> None:
        self._idle.append((time.monotonic(), connection))

    async def _connect(self) -> _Connection:
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                reader, writer = await asyncio.open_connection(self.host, self.port)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"no connection to {self.host}:{self.port} in time") from None
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to {self.host}:{self.port}: {exc}") from None
        return _Connection(reader, writer)

    def close(self) -> None:
        for _, connection in self._idle:
            connection.close()
        self._idle.clear()


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.h11 = h11.Connection(h11.CLIENT)

    def reusable(self) -> bool:
        return (
            not self.writer.is_closing()
            and not self.reader.at_eof()
            and self.h11.our_state is h11.IDLE
            and self.h11.their_state is h11.IDLE
        )

    async def exchange(self, request: httpx.Request) -> h11.Response:
        """Write ``request``, then read until the answer's head."""
        target = request.url.raw_path
        headers = [(name, value) for name, value in request.headers.raw if name.lower() != b"host"]
        headers.insert(0, (b"host", request.url.netloc))
        if request.method == "POST" and b"content-length" not in (name.lower() for name, _ in headers):
            headers.append((b"content-length", str(len(request.content)).encode()))
        data = self.h11.send(h11.Request(method=request.method, target=target, headers=headers))
        assert data is not None
        data += self.h11.send(h11.Data(data=request.content)) or b""
        data += self.h11.send(h11.EndOfMessage()) or b""
        try:
            self.writer.write(data)
            await self.writer.drain()
        except OSError as exc:
            raise httpx.WriteError(f"sending the request failed: {exc!r}") from None
        while True:
            event = await self.next_event()
            if isinstance(event, h11.Response):
                return event
            if not isinstance(event, h11.InformationalResponse):
                raise httpx.RemoteProtocolError(f"unexpected {type(event).__name__} before the answer's head")

    async def next_event(self) -> h11.Event | type[h11.NEED_DATA] | type[h11.PAUSED]:
        """The next event, reading from the socket when h11 needs more."""
        while True:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError as exc:
                raise httpx.RemoteProtocolError(str(exc)) from None
            if event is not h11.NEED_DATA:
                return event
            await self.receive()

    async def receive(self) -> None:
        self.h11.receive_data(await self.read())  # b"": the server closed (h11 raises if mid-message)

    async def read(self) -> bytes:
        try:
            return await self.reader.read(READ_BYTES)
        except OSError as exc:
            raise httpx.ReadError(f"reading the answer failed: {exc!r}") from None

    def close(self) -> None:
        self.writer.close()


class _Chunks:
    """A chunked body's framing, taken off here rather than by h11 (a third of the
    gateway's time reading a stream went to h11's parsing, chunk by chunk)."""

    def __init__(self, received: bytes) -> None:
        self.buffer = bytearray(received)
        self.left = 0  # bytes of the current chunk's data still to come
        self.crlf = False  # the current chunk's data ended: its CRLF comes next
        self.trailers = False  # the last chunk came: trailer lines, then an empty line
        self.done = False

    def decode(self) -> list[bytes]:
        """The data of every chunk the buffer holds (a chunk split across reads: its part)."""
        buffer, parts = self.buffer, []
        while buffer and not self.done:
            if self.left:
                taken = bytes(buffer[: self.left])
                del buffer[: len(taken)]
                self.left -= len(taken)
                self.crlf = not self.left
                parts.append(taken)
                continue
            if self.crlf:
                if len(buffer) < 2:
                    break
                if buffer[:2] != b"\r\n":
                    raise httpx.RemoteProtocolError("a chunk's data is not followed by CRLF")
                del buffer[:2]
                self.crlf = False
                continue
            end = buffer.find(b"\r\n")
            if end < 0:
                if len(buffer) > 4096:
                    raise httpx.RemoteProtocolError("a chunk's size line is too long")
                break
            line = bytes(buffer[:end])
            del buffer[: end + 2]
            if self.trailers:
                self.done = not line  # trailer fields are dropped, as httpx drops them
                continue
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise httpx.RemoteProtocolError(f"a malformed chunk size line: {line[:40]!r}") from None
            if size < 0:
                raise httpx.RemoteProtocolError(f"a malformed chunk size line: {line[:40]!r}")
            self.left, self.trailers = size, size == 0
        return parts


class _Body(httpx.AsyncByteStream):
    """An answer's body: all of it that one socket read brought, chunk framing removed."""

    def __init__(
        self, connection: _Connection, connections: Connections, chunks: _Chunks | None, *, keep_alive: bool
    ) -> None:
        self.connection = connection
        self.connections = connections
        self.chunks = chunks  # None: h11 frames the body (a length, or until the close)
        self.keep_alive = keep_alive
        self.ended = False
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        connection, chunks = self.connection, self.chunks
        while chunks is not None and not self.ended:
            parts = chunks.decode()
            self.ended = chunks.done
            if parts:
                yield parts[0] if len(parts) == 1 else b"".join(parts)
            elif not self.ended:
                received = await connection.read()
                if not received:
                    raise httpx.RemoteProtocolError("the server closed the connection mid-body")
                chunks.buffer += received
        while not self.ended:
            parts = []
            event: h11.Event | type[h11.NEED_DATA] | type[h11.PAUSED] = await connection.next_event()
            while True:
                if isinstance(event, h11.Data):
                    parts.append(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage):
                    self.ended = True
                    break
                elif event is h11.NEED_DATA or event is h11.PAUSED:
                    break
                else:
                    raise httpx.RemoteProtocolError(f"unexpected {event!r} in an answer's body")
                try:  # what the same read brought: h11 parses it without reading again
                    event = connection.h11.next_event()
                except h11.RemoteProtocolError as exc:
                    raise httpx.RemoteProtocolError(str(exc)) from None
            if parts:
                yield parts[0] if len(parts) == 1 else b"".join(parts)

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        connection, chunks = self.connection, self.chunks
        if chunks is not None:
            if self.ended and self.keep_alive and not chunks.buffer:
                connection.h11 = h11.Connection(h11.CLIENT)  # its body framed here: h11 starts afresh
                self.connections.give_back(connection)
            else:
                connection.close()
        elif self.ended and connection.h11.our_state is h11.DONE and connection.h11.their_state is h11.DONE:
            connection.h11.start_next_cycle()
            self.connections.give_back(connection)
        else:
            connection.close()


def lean_connections(base_url: str, *, connect_timeout_s: float) -> Connections | None:
    """Connections of this module for ``base_url``, or ``None`` where httpx must go (TLS,
    a proxy from the environment, no port it can tell)."""
    url = httpx.URL(base_url)
    if url.scheme != "http" or not url.host:
        return None
    proxies = urllib.request.getproxies()
    if (proxies.get("http") or proxies.get("all")) and not urllib.request.proxy_bypass(url.host):
        return None
    return Connections(url.host, url.port or 80, connect_timeout_s=connect_timeout_s)
