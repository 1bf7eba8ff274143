"""A request's response on the server (``app/http/server.py``): uvicorn's request-response
cycle, with a streamed body's chunks written by a ``ChunkWriter`` and its head sent in
the same write as its first chunk.

- ``ChunkWriter`` (the scope's ``CHUNK_WRITER``) writes the body chunks of a response
  that has no ``Content-Length`` (a stream) without an ASGI message each, framed here
  rather than by uvicorn's ``send``. The response's start and its end still go through
  the ASGI ``send``, and so does every chunk of a body that is not chunked.
- A chunked response's head is held until its first chunk and goes out in the same
  write, or at the event loop's next turn if no chunk comes in the step that started
  the response: one ``send`` and one segment less a stream, and the client reads the
  head and the first event at once (a streamed answer starts once its first events are
  ready: app/api/token_stream.py).
- A body without ``Content-Length`` sent to an HTTP/1.0 client is delimited by the
  connection's close (which the cycle does for 1.0), not chunked: uvicorn's httptools
  protocol chunks it, which an HTTP/1.0 client cannot read.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

# The scope's key for the request's ``ChunkWriter``.
CHUNK_WRITER = "phasegate.chunk_writer"


class ChunkWriter:
    """Writes the body chunks of one response that has no ``Content-Length`` (a stream)
    as uvicorn's ``send`` of an ``http.response.body`` message would, less its per-chunk
    cost: no message dict, and the chunk framed here."""

    __slots__ = ("cycle",)

    def __init__(self, cycle: Cycle) -> None:
        self.cycle = cycle

    def write_now(self, data: bytes) -> bool:
        """Write ``data`` as one chunk if that asks for no wait: the response started and
        is chunked, the client is there and the socket's buffer is not full; whether it
        was written (if not, ``write`` does what is left to do)."""
        cycle = self.cycle
        if (
            not data  # an empty chunk would end the body
            or not cycle.chunked_encoding  # set by the response's start
            or cycle.response_complete
            or cycle.flow.write_paused
            or cycle.disconnected
        ):
            return False
        cycle.write_chunk(data)
        return True

    async def write(self, data: bytes) -> None:
        """Write ``data`` as one chunk, after the socket's buffer drained if it was full;
        nothing once the client is gone (as uvicorn's ``send``)."""
        if self.write_now(data):
            return
        cycle = self.cycle
        if not cycle.chunked_encoding or cycle.response_complete:
            await cycle.send({"type": "http.response.body", "body": data, "more_body": True})
            return
        if cycle.flow.write_paused and not cycle.disconnected:
            await cycle.flow.drain()
        if cycle.disconnected or not data:  # an empty chunk would end the body
            return
        cycle.write_chunk(data)


class _Head:
    """Takes the write of a response's head in place of the transport."""

    __slots__ = ("data",)

    def __init__(self) -> None:
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data


class Cycle(RequestResponseCycle):
    """uvicorn's request-response cycle, with the module docstring's held head and
    HTTP/1.0 bodies: the latter told to uvicorn as a content length that no body
    reaches, until its last part."""

    close_delimited = False
    held_head: bytes | None = None  # a chunked response's head, not written yet

    async def send(self, message: Any) -> None:
        if message["type"] == "http.response.start":
            headers = message.get("headers", ())
            if (
                self.scope["http_version"] == "1.0"
                and self.chunked_encoding is None
                and not any(name.lower() == b"content-length" for name, _ in headers)
            ):
                self.chunked_encoding, self.close_delimited = False, True
                self.expected_content_length = sys.maxsize
            if self.flow.write_paused and not self.disconnected:
                await self.flow.drain()  # as uvicorn's send does first: it then runs in one step
            transport, head = self.transport, _Head()
            self.transport = head  # type: ignore[assignment]  # uvicorn writes the head here
            try:
                await super().send(message)
            finally:
                self.transport = transport
            if self.chunked_encoding and head.data:
                self.held_head = head.data
                asyncio.get_running_loop().call_soon(self.release_head)
            elif head.data:
                transport.write(head.data)
            return
        self.release_head()
        if self.close_delimited and not message.get("more_body", False):
            self.expected_content_length = len(message.get("body", b""))  # the end: nothing is missing
        await super().send(message)

    def write_chunk(self, data: bytes) -> None:
        """Write ``data`` as one chunk, after the head if it is still held."""
        chunk = b"%x\r\n%b\r\n" % (len(data), data)
        head = self.held_head
        if head is not None:
            self.held_head, chunk = None, head + chunk
        self.transport.write(chunk)

    def release_head(self) -> None:
        """Write the head if it is still held (no chunk came in the step that started the response)."""
        head, self.held_head = self.held_head, None
        if head is not None and not self.disconnected:
            self.transport.write(head)
