"""Waiting in a test for something to become true, with a deadline instead of a guess."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(condition: Callable[[], object], timeout: float = 15.0) -> None:
    """Wait for ``condition()``: a loaded machine only makes it later, never false."""
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)
