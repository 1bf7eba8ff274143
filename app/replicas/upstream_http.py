"""HTTP/1.1 for the hot request of an OpenAI upstream (a streamed completion), lean.

How this works: the caller gives the request as bytes (its target, its header lines,
its body: the fixed headers encoded once per upstream), this module writes them in one
write on a kept-alive connection of its own, reads the answer's head and hands the
body over as it is read: one socket read is one body read (:meth:`Body.read`), however
many chunks it holds (the tokens that piled up while the gateway was busy come
together). httpx's own transport put five async generators, an anyio cancel scope and
h11 between each chunk of the body and the gateway, and its pool closed every
connection whose body ended unread, so each attempt paid for a new TCP connection too;
building an ``httpx.Request`` and framing it through h11 cost more than the rest of
starting an attempt.

A connection goes back to the idle list only once its body was read to its end;
closed before that (a cancel, a fence: closing is how vLLM aborts) it is closed. An
idle connection is used again only while it is younger than ``IDLE_S`` and its server
has not closed it, so a request is never sent on a connection its server dropped
(servers time idle connections out: uvicorn after 5 s). Errors are httpx's own
(``ConnectError``, ``ConnectTimeout``, ``ReadError``, ``RemoteProtocolError``,
``WriteError``), so a caller maps them as it maps httpx's. Only ``http://`` without
a proxy from the environment comes here; anything else stays with httpx
(:func:`lean_connections`).
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Callable

import httpx

from app.replicas.chunked import Chunks, whole_chunks

IDLE_S = 2.0  # an idle connection older than this is closed rather than used again
READ_BYTES = 65536
HEAD_MAX_BYTES = 65536  # an answer's head longer than this is refused
_NO_BODY = frozenset({204, 304})


class Connections:
    """The kept-alive connections to one ``host:port``."""

    def __init__(self, host: str, port: int, *, connect_timeout_s: float) -> None:
        self.host, self.port = host, port
        self.connect_timeout_s = connect_timeout_s
        named = f"[{host}]" if ":" in host else host  # an IPv6 address
        self._host_line = b"host: %s\r\n" % (named if port == 80 else f"{named}:{port}").encode("ascii")
        self._idle: list[tuple[float, _Connection]] = []
        self._open: set[_Connection] = set()  # idle or carrying a body: all closed by close()

    async def post(
        self, target: bytes, header_lines: bytes, body: bytes, *, head_timeout_s: float | None = None
    ) -> Answer:
        """POST ``body`` to ``target`` with ``header_lines`` (each ``name: value\\r\\n``,
        :func:`header_line`; the host and the content length are added here), and return
        once the answer's head came: within ``head_timeout_s`` of the request's write, or
        ``ReadTimeout`` (as httpx's read timeout; the connect has its own)."""
        request = b"POST %s HTTP/1.1\r\n%s%scontent-length: %d\r\n\r\n%s" % (
            target,
            self._host_line,
            header_lines,
            len(body),
            body,
        )
        connection = self._take_idle() or await self._connect()
        try:
            connection.write(request)
            async with asyncio.timeout(head_timeout_s):
                return await connection.answer(self)
        except TimeoutError:
            self.discard(connection)
            raise httpx.ReadTimeout(f"no answer from {self.host}:{self.port} within {head_timeout_s:g} s") from None
        except BaseException:
            self.discard(connection)
            raise

    def _take_idle(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            since, connection = self._idle.pop()
            if now - since < IDLE_S and connection.reusable():
                return connection
            self.discard(connection)
        return None

    def give_back(self, connection: _Connection) -> None:
        self._idle.append((time.monotonic(), connection))

    def discard(self, connection: _Connection) -> None:
        self._open.discard(connection)
        connection.close()

    async def _connect(self) -> _Connection:
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                # as asyncio.open_connection does, with a protocol that can be tapped
                loop = asyncio.get_running_loop()
                reader = asyncio.StreamReader(loop=loop)
                protocol = _Protocol(reader, loop=loop)
                transport, _ = await loop.create_connection(lambda: protocol, self.host, self.port)
                writer = asyncio.StreamWriter(transport, protocol, reader, loop)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"no connection to {self.host}:{self.port} in time") from None
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to {self.host}:{self.port}: {exc}") from None
        connection = _Connection(reader, writer, protocol)
        self._open.add(connection)
        return connection

    def close(self) -> None:
        """Close every connection, the idle ones and those whose body is still being read
        (as closing an ``httpx.AsyncClient`` does)."""
        for connection in self._open:
            connection.close()
        self._open.clear()
        self._idle.clear()


class Answer:
    """An answer's status, head and body (read with :meth:`Body.read`)."""

    __slots__ = ("body", "headers", "reason_phrase", "status_code")

    def __init__(self, status_code: int, reason_phrase: str, headers: dict[str, str], body: Body) -> None:
        self.status_code = status_code
        self.reason_phrase = reason_phrase
        self.headers = headers  # names in lower case; a repeated field's values joined by ", "
        self.body = body


class _Protocol(asyncio.StreamReaderProtocol):
    """asyncio's stream protocol, whose arrivals go first to a tap while one is set
    (:meth:`Body.tap`). A tap that declines an arrival is removed with it: nothing it
    takes later may overtake what went to the reader."""

    tap: Callable[[bytes], bool] | None = None

    def data_received(self, data: bytes) -> None:
        tap = self.tap
        if tap is not None:
            if tap(data):
                return
            self.tap = None
        super().data_received(data)


class _Connection:
    __slots__ = ("protocol", "reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, protocol: _Protocol) -> None:
        self.reader, self.writer, self.protocol = reader, writer, protocol

    def reusable(self) -> bool:
        return not self.writer.is_closing() and not self.reader.at_eof()

    def write(self, data: bytes) -> None:
        try:
            self.writer.write(data)  # a request fits the transport's buffer: no drain to wait for
        except OSError as exc:
            raise httpx.WriteError(f"sending the request failed: {exc!r}") from None

    async def answer(self, connections: Connections) -> Answer:
        """Read until the answer's head (informational answers skipped) and frame its body."""
        received = b""
        while True:
            end = received.find(b"\r\n\r\n")
            if end < 0:
                if len(received) > HEAD_MAX_BYTES:
                    raise httpx.RemoteProtocolError("the answer's head is too long")
                more = await self.read()
                if not more:
                    raise httpx.RemoteProtocolError("the server closed the connection before answering")
                received += more
                continue
            head, received = received[:end], received[end + 4 :]
            status, reason, version, headers = _parse_head(head)
            if 100 <= status < 200:
                if status == 101:
                    raise httpx.RemoteProtocolError("the server switched protocols")
                continue  # 100 Continue, 103 Early Hints: the answer follows
            break
        keep_alive = version == b"HTTP/1.1" and "close" not in headers.get("connection", "").lower()
        if status in _NO_BODY:
            framing: Chunks | int | None = 0
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            framing = Chunks(received)
            received = b""
        elif "content-length" in headers:
            try:
                framing = int(headers["content-length"])
            except ValueError:
                raise httpx.RemoteProtocolError("a malformed content-length") from None
            if framing < 0:
                raise httpx.RemoteProtocolError("a malformed content-length")
        else:
            framing, keep_alive = None, False  # until the server closes
        return Answer(status, reason, headers, Body(self, connections, framing, received, keep_alive=keep_alive))

    async def read(self) -> bytes:
        try:
            return await self.reader.read(READ_BYTES)
        except OSError as exc:
            raise httpx.ReadError(f"reading the answer failed: {exc!r}") from None

    def close(self) -> None:
        self.writer.close()


def _parse_head(head: bytes) -> tuple[int, str, bytes, dict[str, str]]:
    """Status, reason, HTTP version and fields of an answer's head (without its blank line)."""
    status_line, *lines = head.split(b"\r\n")
    version, _, rest = status_line.partition(b" ")
    code, _, reason = rest.partition(b" ")
    if not version.startswith(b"HTTP/1.") or len(code) != 3 or not code.isdigit():
        raise httpx.RemoteProtocolError(f"a malformed status line: {status_line[:60]!r}")
    headers: dict[str, str] = {}
    for line in lines:
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip():
            raise httpx.RemoteProtocolError(f"a malformed header line: {line[:60]!r}")
        key, text = name.decode("latin-1").lower(), value.strip().decode("latin-1")
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
    return int(code), reason.decode("latin-1"), version, headers


class Body:
    """An answer's body: all of it that one socket read brought, its framing removed."""

    def __init__(
        self,
        connection: _Connection,
        connections: Connections,
        framing: Chunks | int | None,
        received: bytes,
        *,
        keep_alive: bool,
    ) -> None:
        self.connection = connection
        self.connections = connections
        self.framing = framing  # chunked; the bytes still to come (a length); None: until the close
        self.received = received  # body bytes read with the head (not chunked)
        self.keep_alive = keep_alive
        self.ended = False
        self.closed = False
        self._take: Callable[[bytes], bool] | None = None  # a tap's taker (``tap``)

    async def read(self) -> bytes:
        """The body's next bytes, ``b""`` once it ended."""
        framing = self.framing
        if type(framing) is Chunks:
            while not self.ended:
                parts = framing.decode()
                self.ended = framing.done
                if parts:
                    return parts[0] if len(parts) == 1 else b"".join(parts)
                if not self.ended:
                    received = await self.connection.read()
                    if not received:
                        raise httpx.RemoteProtocolError("the server closed the connection mid-body")
                    framing.buffer += received
            return b""
        if self.ended:
            return b""
        received, self.received = self.received, b""
        if not received and framing != 0:
            received = await self.connection.read()
            if not received:
                if framing is not None:
                    raise httpx.RemoteProtocolError("the server closed the connection mid-body")
                self.ended = True  # the body that lasts until the close
                return b""
        if type(framing) is int:
            if len(received) > framing:
                received, self.keep_alive = received[:framing], False  # more than it said: not reused
            self.framing = framing = framing - len(received)
            self.ended = framing == 0
        return received

    def tap(self, take: Callable[[bytes], bool] | None) -> None:
        """Offer the body's next socket reads to ``take`` first, in the connection's own
        callback, while nothing of them is read yet (``None``: no more). Only a read of
        whole chunks (none the last) that comes between chunks is offered, as their data:
        what ``take`` takes leaves the framing as it was and never reaches :meth:`read`;
        the first read it declines, and all after it, go to :meth:`read` as before."""
        protocol = self.connection.protocol
        framing = self.framing
        if take is None or type(framing) is not Chunks or not framing.between_chunks:
            protocol.tap = None
            return
        self._take = take
        protocol.tap = self._offered

    def _offered(self, received: bytes) -> bool:
        take = self._take
        parts, taken = whole_chunks(received)
        if take is None or taken != len(received) or not parts:
            return False
        return take(parts[0] if len(parts) == 1 else b"".join(parts))

    async def aclose(self) -> None:
        """Done with the body: its connection kept if it was read to its end, else closed."""
        if self.closed:
            return
        self.closed = True
        framing = self.framing
        clean = type(framing) is not Chunks or not framing.buffer  # nothing read past the body
        if self.ended and self.keep_alive and clean:
            self.connections.give_back(self.connection)
        else:
            self.connections.discard(self.connection)


def lean_connections(base_url: str, *, connect_timeout_s: float) -> Connections | None:
    """Connections of this module for ``base_url``, or ``None`` where httpx must go (TLS,
    a proxy from the environment, no port it can tell)."""
    url = httpx.URL(base_url)
    if url.scheme != "http" or not url.host:
        return None
    proxies = urllib.request.getproxies()
    if (proxies.get("http") or proxies.get("all")) and not urllib.request.proxy_bypass(url.host):
        return None
    return Connections(url.raw_host.decode("ascii"), url.port or 80, connect_timeout_s=connect_timeout_s)
