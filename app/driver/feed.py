"""A request's outputs, produced by its loop in a task of its own, for one attached client.

How this works: the loop (``RequestLoop._drive``) runs in the feed's task, so a client
that leaves (its HTTP task cancelled) never stops the generation: it only detaches
(docs/design.md §12). The feed keeps every delta of the current attempt in memory, in
order; the attached :class:`AttachedClient` reads them with its own cursor, so a
client that attaches again (a resume on this instance) starts at any delta it names.

While a client is attached the loop reads on as tokens come, and the client takes every
delta there is when it comes back for more (``ready_deltas``: one write for all of them
when it fell behind). A client that is caught up (it took every delta and waits for the
next) may take a new delta in the loop's own task, as it comes (``AttachedClient.direct``:
the HTTP layer's write that needs no wait, and its record of the delivery): no hand-off
to the client's task a token (with the tokens taken in an upstream connection's callback,
``offer``, neither task is woken for one, and the deltas of one read go out in one write);
a delta it cannot take so (a full socket buffer, the log behind) waits for its task as
any other, and so do those after it. Before the loop observes anything but a token (a
failure, the end, a drain, a decision) it waits until the client has taken every delta
and come back for more (``client_caught_up``), as when the client pulled the loop
itself: what it then decides is decided on deliveries that are all recorded, so the final
error's counts are what the client got, and the log's order is the order things
happened. While no client is attached the loop runs free: each new delta is recorded as
produced (the driver's ``on_unattended``), and the final output (finished, failed,
cancelled) is kept for whoever reads next.

An exception of the loop (the log lost) reaches the attached client, which answers it;
with no client attached, the driver's ``on_unattended_error`` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from app.driver.outputs import Delta, Output, Restarted

log = logging.getLogger("phasegate.driver")


class AttachedClient:
    """One client's reading end of the feed: an async iterator of outputs, from ``cursor``."""

    def __init__(self, feed: Feed, cursor: int) -> None:
        self.feed = feed
        self.cursor = cursor  # the next delta index this client gets
        self.restarts = feed.restarts
        self.got_end = False
        # while it waits caught up: writes deltas to the client and records them delivered,
        # in the loop's task, as far as that needs no wait; how many, from the first (those
        # it did not take are queued)
        self.direct: Callable[[list[Delta]], int] | None = None

    def __aiter__(self) -> AttachedClient:
        return self

    async def __anext__(self) -> Output:
        return await self.feed.next_for(self)

    def ready_deltas(self, most: int) -> list[Delta]:
        """Up to ``most`` deltas that came after the last one taken, taken now (none
        after a restart this client was not told of yet, or once detached)."""
        feed = self.feed
        if self is not feed.client or self.restarts != feed.restarts:
            return []
        taken = feed.deltas[self.cursor : self.cursor + most]
        self.cursor += len(taken)
        return taken


class Feed:
    def __init__(
        self,
        outputs: Callable[[], AsyncGenerator[Output, None]],
        spawn: Callable[..., asyncio.Task[Any]],
        *,
        on_unattended: Callable[[Output], Awaitable[None] | None],
        on_unattended_error: Callable[[BaseException], None],
        name: str,
    ) -> None:
        self._outputs = outputs
        self._spawn = spawn
        self._on_unattended = on_unattended  # a delta or the end, produced with no client attached
        self._on_unattended_error = on_unattended_error
        self._name = name
        self.deltas: list[Delta] = []  # the current attempt's, in order
        self.restarts = 0  # a retry replaced an attempt whose output no client received
        self.end: Output | None = None  # finished, failed or cancelled: the last output
        self.error: BaseException | None = None  # what the loop raised
        self.client: AttachedClient | None = None
        self._task: asyncio.Task[None] | None = None
        self.over = False  # the loop ran to its end (or raised)
        self._waiter: asyncio.Future[None] | None = None  # the client waits for an output
        self._caught_up: asyncio.Future[None] | None = None  # the loop waits for the client
        self._client_waiting = False

    def start(self) -> None:
        if self._task is None:
            self._task = self._spawn(self._run(), name=self._name)

    def attach(self, cursor: int) -> AttachedClient:
        """Attach a client that gets deltas from ``cursor`` on; the one before is detached."""
        self.client = AttachedClient(self, cursor)
        self._wake()  # the client before it, if it waits, ends
        self._release_loop()
        return self.client

    def detach(self) -> AttachedClient | None:
        client, self.client = self.client, None
        self._wake()  # a read that waits ends (StopAsyncIteration)
        self._release_loop()
        return client

    async def stop(self) -> None:
        """Stop the loop where it stands (the log was lost); it records nothing more."""
        task = self._task
        if task is not None and task is not asyncio.current_task() and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def next_for(self, client: AttachedClient) -> Output:
        self.start()
        while True:
            if client is not self.client:
                raise StopAsyncIteration  # detached: another client, or none, reads on
            if client.restarts != self.restarts:
                client.restarts, client.cursor = self.restarts, 0
                return Restarted()
            if client.cursor < len(self.deltas):
                client.cursor += 1
                return self.deltas[client.cursor - 1]
            if self.end is not None and not client.got_end:
                client.got_end = True
                return self.end
            if self.error is not None:
                error, self.error = self.error, None
                raise error
            if self.over or client.got_end:
                raise StopAsyncIteration
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            self._client_waiting = True
            self._release_loop()
            try:
                await waiter
            finally:
                self._client_waiting = False  # (also when its task is cancelled)

    def _wake(self) -> None:
        self._client_waiting = False  # woken, it takes what came before it asks again
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _release_loop(self) -> None:
        caught_up, self._caught_up = self._caught_up, None
        if caught_up is not None and not caught_up.done():
            caught_up.set_result(None)

    async def client_caught_up(self) -> None:
        """With a client attached: until it took every delta and asks for more (or left)."""
        while self.client is not None and not self._client_waiting:
            caught_up = self._caught_up = asyncio.get_running_loop().create_future()
            await caught_up

    async def _run(self) -> None:
        try:
            async with contextlib.aclosing(self._outputs()) as outputs:  # closed here, even when stopped
                async for output in outputs:
                    if type(output) is Delta and self._taken_directly([output]):
                        continue  # the client is still caught up and waiting: nothing to wake
                    unattended = self._take(output)
                    if unattended is not None:
                        await unattended
                    self._wake()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the log lost, or a bug: whoever reads answers it
            if self.client is not None:
                self.error = exc
            else:
                self._on_unattended_error(exc)
        finally:
            self.over = True
            self._wake()

    def offer(self, deltas: list[Delta]) -> None:
        """Deltas the loop produced outside this feed's task, in the upstream connection's
        callback (``RequestLoop._tokens_now``: the tokens of one read), with a client
        attached: kept and handed over as if the loop had yielded them, one by one."""
        assert self.client is not None, "offered with no client attached"
        taken = self._taken_directly(deltas)
        if taken < len(deltas):
            for delta in deltas[taken:]:
                self._take(delta)
            self._wake()

    def _taken_directly(self, deltas: list[Delta]) -> int:
        """How many of ``deltas``, from the first, the attached client took in this task,
        caught up and waiting (``AttachedClient.direct``: all of them in one write where
        it can); kept like any delta, for a client attaching later."""
        client = self.client
        if (
            client is None
            or client.direct is None
            or not self._client_waiting
            or client.cursor != len(self.deltas)
            or client.restarts != self.restarts
        ):
            return 0
        taken = client.direct(deltas)
        if taken:
            self.deltas.extend(deltas[:taken])
            client.cursor += taken
        return taken

    def _take(self, output: Output) -> Awaitable[None] | None:
        """Keep ``output`` for the client; what is left to await of handling it with no
        client attached. (Not a coroutine: a plain call per delta.)"""
        if type(output) is Delta:
            self.deltas.append(output)
        elif type(output) is Restarted:
            self.deltas.clear()
            self.restarts += 1
        else:
            self.end = output
        if self.client is None and type(output) is not Restarted:
            return self._on_unattended(output)
        return None
