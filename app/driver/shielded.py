"""``await shielded(coroutine)``: work that a cancellation of its caller must not stop.

How this works: ``asyncio.shield`` runs the coroutine in a task of its own, which costs
a task and a turn of the event loop before the coroutine even starts, and another to
hand its result back, though most of what the driver shields never suspends (a
group-committed append is only queued). Here the coroutine runs in the caller's task
up to its first suspension, as a plain ``await`` would run it; if it ends there, that
is all. If it suspends, the rest of it runs in a task of its own, driven on from that
suspension exactly as a task drives a coroutine, and the caller waits for that task
through ``asyncio.shield``: cancelling the caller cancels its wait, never the work.

``begun(coroutine)`` starts the same way but does not wait: the caller gets a future of
the outcome and does other work while the rest runs (the commit point's append while
the response is made ready: app/api/generate.py).

The first step runs in the caller's task, so it must not keep that task for later
(``asyncio.timeout`` or ``current_task()`` before the first suspension).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


async def shielded(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run ``coroutine`` to its end even if the caller is cancelled meanwhile."""
    try:
        awaited = coroutine.send(None)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]
    task = asyncio.get_running_loop().create_task(_drive_on(coroutine, awaited))
    return await asyncio.shield(task)


def begun(coroutine: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
    """Run ``coroutine`` up to its first suspension now, in the caller's step, and the
    rest in a task of its own; its outcome as a future, which the caller awaits later
    (through ``asyncio.shield``, so that a cancelled wait leaves the work running)."""
    try:
        awaited = coroutine.send(None)
    except StopIteration as stop:
        done: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        done.set_result(stop.value)
        return done
    except Exception as exc:  # raised in the first step: the future's outcome
        failed: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        failed.set_exception(exc)
        return failed
    return asyncio.get_running_loop().create_task(_drive_on(coroutine, awaited))


async def _drive_on(coroutine: Coroutine[Any, Any, T], awaited: Any) -> T:
    """Drive ``coroutine`` on from its suspension on ``awaited`` (a future, or ``None``
    for a bare yield), as a task would: the outcome of each awaited future sent or thrown in."""
    while True:
        try:
            if awaited is None:
                await asyncio.sleep(0)
            else:
                awaited._asyncio_future_blocking = False  # taken, as a task takes it: awaited again here
                await awaited
        except BaseException as exc:  # cancelled too: the coroutine decides what that means
            try:
                awaited = coroutine.throw(exc)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            continue
        try:
            awaited = coroutine.send(None)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
