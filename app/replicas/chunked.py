"""A chunked HTTP/1.1 body's framing (``Transfer-Encoding: chunked``), taken off by
``bytes.find`` over what each socket read brought: h11, event by event, took a third
of the gateway's time reading a stream."""

from __future__ import annotations

import httpx


def whole_chunks(received: bytes | bytearray) -> tuple[list[bytes], int]:
    """The data of the whole chunks at the start of ``received`` (each with a size line
    without extensions, none the last chunk), and how many bytes they took; a read
    mostly brings whole ones, each taken in one step."""
    parts: list[bytes] = []
    at, size = 0, len(received)
    while (end := received.find(b"\r\n", at)) > at:
        try:
            length = int(received[at:end], 16)  # a size line with no extension
        except ValueError:
            break  # an extension, or malformed: the step by step way tells
        start = end + 2
        stop = start + length
        if length <= 0 or size < stop + 2 or received[stop : stop + 2] != b"\r\n":
            break
        parts.append(bytes(received[start:stop]))
        at = stop + 2
    return parts, at


class Chunks:
    """One chunked body's framing, as its reads come."""

    def __init__(self, received: bytes) -> None:
        self.buffer = bytearray(received)
        self.left = 0  # bytes of the current chunk's data still to come
        self.crlf = False  # the current chunk's data ended: its CRLF comes next
        self.trailers = False  # the last chunk came: trailer lines, then an empty line
        self.done = False

    @property
    def between_chunks(self) -> bool:
        """Nothing of a chunk is pending: the next bytes start a chunk's size line."""
        return not self.buffer and not self.left and not self.crlf and not self.trailers and not self.done

    def decode(self) -> list[bytes]:
        """The data of every chunk the buffer holds (a chunk split across reads: its part)."""
        buffer, parts = self.buffer, list[bytes]()
        if not self.left and not self.crlf and not self.trailers:
            # whole chunks first, each in one step (a read mostly brings whole ones)
            parts, at = whole_chunks(buffer)
            del buffer[:at]
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
