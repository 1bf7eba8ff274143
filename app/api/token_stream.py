"""The response of a streamed answer: sse-starlette's headers and framing, and a way
through the ASGI server's own ``send`` that costs less per request and per token.

How this works. sse-starlette's ``EventSourceResponse`` runs each response as an anyio
task group of four tasks (the stream, pings, a watch on the server's exit, a watch on
``receive()`` for the client leaving), sends each event under its own
``anyio.move_on_after`` (a cancel scope, and sniffio asking which library runs), and
through Starlette's ``send``, wrapped twice (the error middleware and the route's
exception handler each check for the response start). On the per-token path that was
about a quarter of the gateway's CPU (``docs/performance.md``), so this response keeps
sse-starlette's headers and its ``SendTimeoutError`` but runs the stream in the
request's own task:

- the response starts once the body's first item is ready: a stream's body waits there
  for its commit point, begun while the response was made ready (app/api/generate.py),
  and may refuse the stream instead (:class:`Refused`: a 503 goes out in its place);
- the response's start and end go through Starlette's ``send``, so its wrappers see the
  response start and end as they would; every body event goes to the server's
  ``ChunkWriter`` (``CHUNK_WRITER``, ``app/http/cycle.py``): no ASGI message, no
  wrapper, no framing by the server's ``send`` per event (under another server, through Starlette's ``send``);
- the client leaving is a callback on the server's ``CLIENT_GONE`` future (a task
  awaiting ``receive()`` only under a server without it: ``client_gone``): it cancels the
  stream, which runs the body's cleanup, as sse-starlette's task group did; the body asks
  the same future whether a write that returned reached a client still there;
- the send deadline is one timer a stream, not a scope an event: it looks at the send in
  progress when it fires and moves to that send's deadline, so a client that stops
  reading still ends the stream ``send_timeout`` after the send it blocked began;
- pings are a timer too, which sends a comment only while no event is being sent;
- the server's exit needs no watch: the gateway drains its streams before it tells
  uvicorn to stop (``app/process/gateway_process.py``).

A HEAD request gets sse-starlette's own answer (the head, no body).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, Awaitable, Callable, Mapping
from datetime import UTC, datetime

from sse_starlette import EventSourceResponse
from sse_starlette.sse import SendTimeoutError
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from app.http.cycle import CHUNK_WRITER
from app.http.server import CLIENT_GONE

log = logging.getLogger("phasegate.api")

CLEANUP_S = 5.0  # how long a cancelled stream's body gets to run its cleanup


def client_gone(scope: Scope, receive: Receive) -> asyncio.Future[None]:
    """A future resolved once the client left: the server's (``CLIENT_GONE``), or, under
    a server that has none, one that a task resolves when ``receive()`` says so."""
    gone: asyncio.Future[None] | None = scope.get(CLIENT_GONE)
    if gone is None:
        gone = scope[CLIENT_GONE] = asyncio.get_running_loop().create_future()
        watch = asyncio.ensure_future(_watch_receive(receive, gone))
        gone.add_done_callback(lambda _: watch.cancel())
    return gone


async def _watch_receive(receive: Receive, gone: asyncio.Future[None]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    if not gone.done():
        gone.set_result(None)


class Leaving:
    """Cancels the task that made it when ``gone`` resolves, until ``stop``; ``stop``
    says whether it did, and takes that cancellation back."""

    def __init__(self, gone: asyncio.Future[None]) -> None:
        self.gone = gone
        self.task = asyncio.current_task()
        self.fired = False
        self.active = True
        gone.add_done_callback(self._left)

    def _left(self, _: object) -> None:
        if not self.active:  # scheduled before stop(), run after it
            return
        self.fired = True
        if self.task is not None:
            self.task.cancel()

    def stop(self) -> bool:
        self.active = False
        self.gone.remove_done_callback(self._left)
        if self.fired and self.task is not None:
            self.task.uncancel()
        return self.fired


class Refused(Exception):
    """Raised by a stream's body before its first events: the stream never starts, and
    ``response`` goes out in its place (the commit point could not be made durable)."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


class TokenStreamResponse(EventSourceResponse):
    """The SSE response of a streamed answer, run as the module's docstring says. The
    body yields bytes: each item is one write (one event, or several ready at once).
    The response starts once the body's first item is ready, so a body may wait for
    something before its first events (the commit point) or refuse the stream
    (:class:`Refused`)."""

    def __init__(
        self,
        body: AsyncIterable[bytes],
        *,
        headers: Mapping[str, str] | None = None,
        ping: int = 15,
        send_timeout: float = 30,
    ) -> None:
        super().__init__(body, headers=headers, ping=ping, send_timeout=send_timeout, sep="\n")
        self.events = body  # as sse-starlette's body_iterator, typed: each item one write

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] == "HEAD":
            await super().__call__(scope, receive, send)
            return
        writer = scope.get(CHUNK_WRITER)
        write: Callable[[bytes], Awaitable[None]] = writer.write if writer is not None else _sender(send)
        leaving = Leaving(client_gone(scope, receive))
        deadline = _SendDeadline(self.send_timeout)
        pings: _Pings | None = None
        events = aiter(self.events)
        try:
            try:
                first = await anext(events, None)  # the head goes out with the first events ready
            except Refused as refused:
                deadline.stop()
                leaving.stop()
                await refused.response(scope, receive, send)
                return
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            pings = _Pings(self._ping_interval, write, deadline)
            if first is not None:
                deadline.sending()
                await write(first)
                deadline.sent()
            async for data in events:
                deadline.sending()
                await write(data)
                deadline.sent()
        except BaseException as exc:
            timed_out, left = deadline.stop(), leaving.stop()
            if pings is not None:
                pings.stop()
            await self._close_body()
            if isinstance(exc, asyncio.CancelledError) and not still_cancelled():
                if timed_out:
                    raise SendTimeoutError() from None
                if left:
                    return  # the client left: nothing more to send, the body cleaned up
            raise
        deadline.stop()
        leaving.stop()
        assert pings is not None
        await pings.finish()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _close_body(self) -> None:
        """As sse-starlette does: the iterator, suspended at its yield, runs its cleanup."""
        aclose = getattr(self.events, "aclose", None)
        if aclose is None:
            return
        try:
            async with asyncio.timeout(CLEANUP_S):
                await asyncio.shield(aclose())
        except Exception:
            log.exception("closing a stream's body after a failed send")


def _sender(send: Send) -> Callable[[bytes], Awaitable[None]]:
    async def write(data: bytes) -> None:
        await send({"type": "http.response.body", "body": data, "more_body": True})

    return write


def still_cancelled() -> bool:
    """Whether the task is cancelled from outside too (then the cancellation goes on)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class _SendDeadline:
    """One timer for a stream's sends: a send that has not returned ``timeout`` seconds
    after it began cancels the task that sends (``stop`` then says it did)."""

    def __init__(self, timeout: float | None) -> None:
        self.timeout = timeout
        self.loop = asyncio.get_running_loop()
        self.task = asyncio.current_task()
        self.began: float | None = None  # the send in progress, on the loop's clock
        self.fired = False
        self.timer = None if timeout is None else self.loop.call_later(timeout, self._check)

    def sending(self) -> None:
        self.began = self.loop.time()

    def sent(self) -> None:
        self.began = None

    def _check(self) -> None:
        assert self.timeout is not None
        now = self.loop.time()
        if self.began is not None and now - self.began >= self.timeout:
            self.timer, self.fired = None, True
            if self.task is not None:
                self.task.cancel()
            return
        due = now + self.timeout if self.began is None else self.began + self.timeout
        self.timer = self.loop.call_at(due, self._check)

    def stop(self) -> bool:
        """Disarm; whether the deadline cancelled the task (its cancellation is taken back)."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.fired and self.task is not None:
            self.task.uncancel()
            self.fired = False  # taken back once
            return True
        return False


class _Pings:
    """A comment every ``interval`` seconds (0: none), sent only while no event is: a
    proxy that closes a connection quiet for too long keeps a slow answer's open."""

    def __init__(self, interval: float, write: Callable[[bytes], Awaitable[None]], deadline: _SendDeadline) -> None:
        self.interval = interval
        self.write = write
        self.deadline = deadline
        self.loop = asyncio.get_running_loop()
        self.sending: asyncio.Task[None] | None = None
        self.timer = self.loop.call_later(interval, self._due) if interval > 0 else None

    def _due(self) -> None:
        if self.deadline.began is None and (self.sending is None or self.sending.done()):
            self.sending = self.loop.create_task(self._ping())
        self.timer = self.loop.call_later(self.interval, self._due)

    async def _ping(self) -> None:
        try:
            await self.write(f": ping - {datetime.now(UTC)}\n\n".encode())
        except Exception as exc:  # the stream's own send meets the same failure and ends it
            log.debug("a ping was not sent: %r", exc)

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.sending is not None:
            self.sending.cancel()

    async def finish(self) -> None:
        """Stop; a ping on its way goes out before the response's end."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.sending is not None and not self.sending.done():
            await asyncio.gather(self.sending, return_exceptions=True)
