"""sse-starlette's response for a streamed answer, with a per-token path that costs less.

How this works: sse-starlette sends each event through ``send`` under its own
``anyio.move_on_after(send_timeout)`` (a cancel scope, and sniffio asking which
library runs, per event), and that ``send`` is Starlette's, wrapped twice (the error
middleware and the route's exception handler each check for the response start). Here
the response start, the end, the pings and every refusal go the way they went, but
each body event goes through the server's own ``send``, which the application stashed
in the scope (``SERVER_SEND``): the wrappers only note that a response started, and it
did. The send deadline is one timer per stream, not a scope per event: it looks at the
send in progress when it fires and moves to that send's deadline, so a client that
stops reading still ends the stream ``send_timeout`` after the send it blocked began.
"""

from __future__ import annotations

import asyncio
import logging

import anyio
from sse_starlette import EventSourceResponse
from sse_starlette.sse import SendTimeoutError
from starlette.applications import Starlette
from starlette.types import Receive, Scope, Send

log = logging.getLogger("phasegate.api")

SERVER_SEND = "phasegate.server_send"  # the scope's key for the ASGI server's own send


class ServerSendApp(Starlette):
    """Starlette, which keeps the server's ``send`` in each HTTP scope (``SERVER_SEND``)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[SERVER_SEND] = send
        await super().__call__(scope, receive, send)


class TokenStreamResponse(EventSourceResponse):
    """An :class:`EventSourceResponse` whose body events go out as the module's docstring
    says. The body yields bytes: each item is one write (one event, or several ready at once)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._server_send: Send | None = scope.get(SERVER_SEND) if scope["method"] != "HEAD" else None
        await super().__call__(scope, receive, send)

    async def _stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        body_send = self._server_send or send
        deadline = _SendDeadline(self.send_timeout)
        try:
            async for data in self.body_iterator:
                deadline.sending()
                await body_send({"type": "http.response.body", "body": data, "more_body": True})
                deadline.sent()
        except BaseException as exc:
            timed_out = deadline.stop()
            # as sse-starlette does: the iterator, suspended at its yield, runs its cleanup
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.move_on_after(self._cleanup_timeout, shield=True):
                    try:
                        await aclose()
                    except Exception:
                        log.exception("closing a stream's body after a failed send")
            if timed_out and isinstance(exc, asyncio.CancelledError):
                raise SendTimeoutError() from None
            raise
        deadline.stop()
        async with self._send_lock:
            self.active = False
            await send({"type": "http.response.body", "body": b"", "more_body": False})


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
        return self.fired
