"""A replica's streamed answer body as its readers take it: the bytes each read brought.

Both replica kinds read their stream's body through :class:`BodyReads`, whichever way
it came: the lean connections' ``Body`` (app/replicas/upstream_http.py) for a plain
``http://`` replica, an ``httpx.Response`` through :class:`HttpxBody` where httpx must
stay (TLS, a proxy). So the framing of a stream (SSE lines, the worker's NDJSON frames)
is written once, over either.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

import httpx


class BodyReads(Protocol):
    """An answer's body read by read: ``b""`` once it ended; ``aclose`` when done with it."""

    async def read(self) -> bytes: ...

    async def aclose(self) -> None: ...


class HttpxBody:
    """An ``httpx.Response``'s body read as the lean connections' (TLS, a proxy)."""

    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        encoded = response.headers.get("content-encoding", "identity") != "identity"
        self._reads = aiter(response.aiter_bytes() if encoded else response.aiter_raw())

    async def read(self) -> bytes:
        try:
            return await anext(self._reads)  # never empty before the end
        except StopAsyncIteration:
            return b""

    async def aclose(self) -> None:
        await self._response.aclose()


class ReadsWithin:
    """A body each of whose reads must bring something within ``seconds``, or it raises
    httpx's ``ReadTimeout``, as httpx's own read timeout does."""

    __slots__ = ("_body", "_seconds")

    def __init__(self, body: BodyReads, seconds: float) -> None:
        self._body = body
        self._seconds = seconds

    async def read(self) -> bytes:
        try:
            async with asyncio.timeout(self._seconds):
                return await self._body.read()
        except TimeoutError:
            raise httpx.ReadTimeout(f"nothing read within {self._seconds:g} s") from None

    async def aclose(self) -> None:
        await self._body.aclose()


async def read_offering(body: BodyReads, offer: Callable[[bytes], bool] | None) -> bytes:
    """``body``'s next read; while it is awaited, each read that arrives is first offered
    to ``offer`` in the connection's own callback, and one it takes is not returned
    (``Body.tap``: the lean connections only; over httpx, or without ``offer``, a plain read)."""
    tap = getattr(body, "tap", None) if offer is not None else None
    if tap is None:
        return await body.read()
    tap(offer)
    try:
        return await body.read()
    finally:
        tap(None)


async def read_all(body: BodyReads) -> bytes:
    """The rest of ``body`` (a refusal's error object, say), not closed."""
    parts = []
    while part := await body.read():
        parts.append(part)
    return b"".join(parts)
