"""``await ended(*tasks)``: a process's background loops, stopped for sure.

Cancelling a task once and awaiting it is not enough on Python 3.11: its
``asyncio.wait_for`` (which dnspython's resolver and this project's own loops use)
returns a result that arrives together with a cancellation and drops the cancellation,
so a loop around it goes on as if it had never been cancelled, and whoever awaits it
waits for ever (a gateway whose DNS loop resolves often may then never stop). The helper
cancels again until each task has ended.
"""

from __future__ import annotations

import asyncio
from typing import Any

AGAIN_AFTER_S = 1.0  # a loop's own clean-up has this long before it is cancelled again


async def ended(*tasks: asyncio.Task[Any] | None) -> None:
    """Cancel each task (None: none) and return once all have ended. What they raised
    is theirs: a loop that must report its faults logs them itself."""
    pending = {task for task in tasks if task is not None and task is not asyncio.current_task()}
    while pending:
        for task in pending:
            task.cancel()
        done, pending = await asyncio.wait(pending, timeout=AGAIN_AFTER_S)
        for task in done:
            if not task.cancelled():
                task.exception()  # retrieved: no "exception was never retrieved" at collection
