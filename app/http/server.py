"""The HTTP server of both processes (gateway and worker): uvicorn's httptools protocol, with
limits on how long a client may hold a connection and how large its headers may be.

httptools, not uvicorn's other protocol (h11, pure Python): a request parsed and its
response started and ended cost much less CPU (``ops/bench/http_limits.py``; figures:
docs/performance.md), and every request to the gateway pays it.

uvicorn times out only a kept-alive connection that went idle after a response, and the
next byte disarms that timer: a connection that never sends a byte, or sends its headers
or its body a byte at a time, stayed open for ever (a socket and a file descriptor each,
the slowloris attack). How this works: each connection is in one phase at a time, with
one deadline that a trickle of bytes does not move:

- ``HEADERS``: from the connection's opening, or from the first byte of a later request on
  a kept-alive connection, to the end of the request's headers: ``header_timeout_s``;
- ``BODY``: from the end of the headers to the end of the body: ``body_timeout_s``;
- ``IDLE``: from the end of an exchange to the next byte: ``keep_alive_s`` (this replaces
  uvicorn's own keep-alive timer, which the protocol cancels);
- none while the application answers a request it has read whole (a pipelined request's
  head waits for it too).

A passing deadline closes the connection: with 408 when part of a request's headers came,
silently otherwise (the application reading a body sees the client leave).

Headers over ``max_header_bytes`` get 431, other malformed HTTP 400, both in the OpenAI
error shape. A complete head is measured as parsed (its line and header fields); one still
incomplete by the bytes read since the previous request's headers ended, since the parser
holds a header field until it is whole (a read that brought the end of a pipelined body
counts whole). uvicorn answered malformed requests and closed the socket at once, with
the client's bytes unread, so the kernel reset the connection and the client never read
the answer (a 1 MB header got a reset). Here the answer is written, the write side shut,
and what the client still sends is read and dropped until it closes or ``LINGER_S``
passes (a lingering close, as Apache and nginx do).

A response without ``Content-Length`` is chunked for an HTTP/1.1 client; uvicorn's
httptools protocol chunks it for an HTTP/1.0 client too, which cannot read that, so
here that body is delimited by the connection's close (``app.http.cycle.Cycle``).

Each request's scope also carries ``CLIENT_GONE``: a future resolved when the connection
is lost before the response completed, for an application that must notice a client
leaving while it sends nothing (a stream waiting for its next token) without a task of
its own blocked on ``receive()``; and ``CHUNK_WRITER``, which writes a streamed response's
body chunks straight to the socket (``app.http.cycle.ChunkWriter``).
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, cast

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from app.http.cycle import CHUNK_WRITER, ChunkWriter, Cycle

log = logging.getLogger("phasegate.http")

LINGER_S = 5.0  # how long the bytes of a refused request are read and dropped before closing
# The scope's key for a future that the server resolves when the client leaves before the
# response is complete: an application waits on it, or calls back from it, where it would
# otherwise keep a task awaiting ``receive()`` for ``http.disconnect`` (one a request).
CLIENT_GONE = "phasegate.client_gone"
_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large"}
_REQUEST_LINE = len(b"  HTTP/1.1\r\n")  # a request line's bytes beside its method and target


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """How long a client may take over each part of a request, and how large its headers may be."""

    header_timeout_s: float = 10.0  # the request line and headers, however they trickle
    body_timeout_s: float = 30.0  # the body, from the end of the headers
    keep_alive_s: float = 75.0  # an idle kept-alive connection (longer than clients' own: see below)
    max_header_bytes: int = 16384  # the request line and headers; larger gets 431

    def problems(self) -> list[str]:
        """What is wrong with these limits, one line each, naming the setting's suffix."""
        found = [
            f"{name} must be a positive number of seconds"
            for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s")
            if type(getattr(self, name)) not in (int, float) or not 0 < getattr(self, name) < math.inf
        ]
        if type(self.max_header_bytes) is not int or self.max_header_bytes < 1024:
            found.append("max_header_bytes must be a whole number, at least 1024")
        return found


class ConnectionPhase(enum.Enum):
    HEADERS = "headers"
    BODY = "body"
    IDLE = "idle"


def write_ready_file(path: Path, host: str, port: int) -> None:
    """``{host, port, pid}`` in ``path``, whole or not at all (renamed into place): how a
    process started on port 0 tells its starter where it listens (``--ready-file``)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"host": host, "port": port, "pid": os.getpid()}))
    tmp.replace(path)


def server_config(app: Any, limits: HttpLimits, **options: Any) -> uvicorn.Config:
    """uvicorn's configuration for ``app``, on the httptools protocol held to ``limits``.

    The protocol is named, not left to uvicorn's choice, so that every deployment gets
    these limits. ``keep_alive_s`` should be longer than clients' idle keep-alive (httpx,
    the openai SDK: 5 s) and load balancers' (often 60 s), so that they close idle
    connections first: at uvicorn's 5 s default a request sent on a connection being
    closed got a reset.
    """

    class Protocol(LimitedProtocol):
        pass

    Protocol.limits = limits
    return uvicorn.Config(app, http=Protocol, **options)


class _HeadTooLarge(Exception):
    """Raised in the parser's callback: the parser stops, and the request gets 431."""


class LimitedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the deadlines and answers of the module's docstring."""

    limits: ClassVar[HttpLimits] = HttpLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.phase: ConnectionPhase | None = None
        self.reading: ConnectionPhase | None = None  # the part of a request the parser is in; None between requests
        self.expires_at = 0.0  # the phase's deadline, on the loop's clock
        self.timer: asyncio.TimerHandle | None = None  # due at or before expires_at
        self.received_in_phase = False
        self.lingering = False
        self.head_read = 0  # bytes read since the last request's headers ended (an incomplete head's size)
        self.head_size = 0  # the head being parsed: its target's and header fields' bytes
        self.too_large = False
        self.timeouts = {
            ConnectionPhase.HEADERS: self.limits.header_timeout_s,
            ConnectionPhase.BODY: self.limits.body_timeout_s,
            ConnectionPhase.IDLE: self.limits.keep_alive_s,
        }

    # --- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._enter(ConnectionPhase.HEADERS)

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return  # the rest of a refused request: read, so that the client reads the answer
        if self.phase is ConnectionPhase.IDLE:
            self._enter(ConnectionPhase.HEADERS)  # the first byte of the next request
        self.received_in_phase = True
        if self.reading is not ConnectionPhase.BODY:
            self.head_read += len(data)
        super().data_received(data)
        if (
            self.reading is ConnectionPhase.HEADERS
            and self.head_read > self.limits.max_header_bytes
            and not self.lingering
        ):
            self.too_large = True  # an incomplete head already over the limit
            self.send_400_response("request header fields too large")
        self._follow()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            gone: asyncio.Future[None] | None = cast(dict[str, Any], cycle.scope).get(CLIENT_GONE)
            if gone is not None and not gone.done():
                gone.set_result(None)
        super().connection_lost(exc)

    # --- the parser's callbacks ------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.reading = ConnectionPhase.HEADERS
        self.head_size = _REQUEST_LINE

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        self.head_size += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        super().on_header(name, value)
        self.head_size += len(name) + len(value) + len(b": \r\n")

    def on_headers_complete(self) -> None:
        self.head_read = 0
        if self.head_size + len(self.parser.get_method()) > self.limits.max_header_bytes:
            self.too_large = True
            raise _HeadTooLarge  # the parser fails: uvicorn calls send_400_response
        self.reading = ConnectionPhase.BODY
        super().on_headers_complete()
        cycle = self.cycle  # a request read now has a cycle whose task has not run yet
        if cycle is not None and CLIENT_GONE not in cycle.scope:
            # uvicorn makes the cycle itself; its task has not run yet, and looks up
            # ``cycle.send`` when it does: from here on that is Cycle's
            cycle.__class__ = Cycle
            scope = cast(dict[str, Any], cycle.scope)
            scope[CLIENT_GONE] = self.loop.create_future()
            scope[CHUNK_WRITER] = ChunkWriter(cast(Cycle, cycle))

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self.reading = None

    # --- uvicorn's hooks -------------------------------------------------------------------

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._unset_keepalive_if_required()  # the IDLE phase is the one keep-alive timer
        self._follow()

    def send_400_response(self, msg: str) -> None:
        """A request the parser refused: 431 when its headers outgrew the limit, else 400."""
        if self.too_large:
            self._refuse(
                431,
                "request_header_fields_too_large",
                f"the request line and headers are over the limit of {self.limits.max_header_bytes} bytes",
            )
        else:
            self._refuse(400, "invalid_http_request", "the request is not valid HTTP/1.1")

    # --- the phases ------------------------------------------------------------------------

    def _follow(self) -> None:
        """Move to the phase the parser and the request in hand say the connection is in."""
        cycle = self.cycle
        if self.transport.is_closing() or self.lingering:
            self._disarm()
        elif self.reading is ConnectionPhase.BODY:
            self._enter(ConnectionPhase.BODY)
        elif cycle is not None and not cycle.response_complete:
            self._disarm()  # the application has the request (a pipelined head waits for it)
        elif self.reading is ConnectionPhase.HEADERS or self.phase is ConnectionPhase.HEADERS:
            self._enter(ConnectionPhase.HEADERS)  # part of the next request came (perhaps pipelined)
        else:
            self._enter(ConnectionPhase.IDLE)

    def _enter(self, phase: ConnectionPhase) -> None:
        if phase is self.phase:
            return  # a trickle does not move the deadline
        self.phase = phase
        self.received_in_phase = False
        self.expires_at = self.loop.time() + self.timeouts[phase]
        # One timer a connection, moved only to an earlier deadline (a new request after an
        # idle spell); a later one is looked at when the timer fires. A timer armed and
        # cancelled at every phase was three a request (see ops/bench/http_limits.py).
        if self.timer is None or self.timer.when() > self.expires_at:
            if self.timer is not None:
                self.timer.cancel()
            self.timer = self.loop.call_at(self.expires_at, self._on_timer)

    def _disarm(self) -> None:
        self.phase = None  # a pending timer finds nothing due

    def _on_timer(self) -> None:
        self.timer = None
        if self.phase is None or self.transport.is_closing():
            return
        if self.loop.time() < self.expires_at:  # the phase moved on to a later deadline
            self.timer = self.loop.call_at(self.expires_at, self._on_timer)
            return
        log.debug("closing a connection: its %s took too long", self.phase.value)
        if self.phase is ConnectionPhase.HEADERS and self.received_in_phase:
            self._refuse(408, "request_timeout", f"the request's headers took over {self.limits.header_timeout_s:g} s")
            return
        self.transport.close()

    def _refuse(self, status: int, code: str, message: str) -> None:
        """Answer a request the application never saw, then close without resetting."""
        self._disarm()
        body = json.dumps(
            {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
        ).encode()
        head = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        # Written as bytes, not through h11: its state may not allow a response here (no
        # request was parsed), and nothing more is sent on this connection anyway.
        self.transport.write(
            b"HTTP/1.1 %d %s\r\n" % (status, _REASONS[status])
            + b"".join(b"%s: %s\r\n" % header for header in head)
            + b"\r\n"
            + body
        )
        self.lingering = True
        if self.transport.can_write_eof():
            self.transport.write_eof()  # the client reads the answer, then closes; see eof_received
            self.loop.call_later(LINGER_S, self.transport.close)
        else:  # TLS: no half-close
            self.transport.close()
