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


async def end_leftovers() -> None:
    """Cancel the running loop's other tasks, then abort the transports still open.

    asyncio lists a selector loop's transports only in a private map (``_transports``,
    by file descriptor); a transport is open while it holds its socket (``_sock``)."""
    leftover = asyncio.all_tasks() - {asyncio.current_task()}
    for task in leftover:
        task.cancel()
    await asyncio.gather(*leftover, return_exceptions=True)
    loop = asyncio.get_running_loop()
    transports = list(getattr(loop, "_transports", {}).values())
    open_ = [transport for transport in transports if getattr(transport, "_sock", None) is not None]
    for transport in open_:
        transport.abort()
    if open_:
        await asyncio.sleep(0)  # an abort closes its socket in the loop's next step
