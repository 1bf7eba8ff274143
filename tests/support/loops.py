"""Closing an event loop that a test runs in a thread of its own (a gateway's, a proxy's)
with nothing of it left open.

A transport still open when its loop closes (a connection accepted as its server stopped,
one whose close waits on bytes its peer never reads) is closed later by the garbage
collector, with a ``ResourceWarning`` in whichever test then runs, which the suite's
``filterwarnings = error`` makes that test's failure: a test would fail for another's
leftovers. So the loop's owner ends its tasks and aborts what is left before closing it.
"""

from __future__ import annotations

import asyncio
import io
import threading

from app.tasks import ended


async def end_leftovers() -> None:
    """Cancel the running loop's other tasks, then abort the transports still open.

    asyncio lists a selector loop's transports only in a private map (``_transports``,
    by file descriptor); a transport is open while it holds its socket (``_sock``)."""
    await ended(*asyncio.all_tasks())  # a cancel that Python 3.11 drops is made again (app/tasks.py)
    loop = asyncio.get_running_loop()
    transports = list(getattr(loop, "_transports", {}).values())
    open_ = [transport for transport in transports if getattr(transport, "_sock", None) is not None]
    for transport in open_:
        transport.abort()
    if open_:
        await asyncio.sleep(0)  # an abort closes its socket in the loop's next step


def stopped(thread: threading.Thread, loop: asyncio.AbstractEventLoop, what: str, timeout: float = 30.0) -> None:
    """Wait for ``thread``, which runs ``loop``, to end; a loop still running after ``timeout``
    fails the test with what it runs still (each task's stack), not with an error of the
    teardown that would follow ("this event loop is already running")."""
    thread.join(timeout)
    if thread.is_alive():
        raise AssertionError(f"{what} did not stop within {timeout:g}s; its loop still runs:\n{task_stacks(loop)}")


def task_stacks(loop: asyncio.AbstractEventLoop) -> str:
    """Each task of ``loop`` (running in another thread) and where it waits: read from this
    thread, a look that may race the loop, but enough to tell what it waits for."""
    stacks = io.StringIO()
    for task in asyncio.all_tasks(loop):
        task.print_stack(limit=8, file=stacks)
    return stacks.getvalue()
