"""Freed heap memory handed back to the system (app/process/heap.py): what a gateway under churn
kept resident although its live objects did not grow (docs/operations.md)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from app.process import heap

pytestmark = pytest.mark.skipif(heap._TRIM is None, reason="no malloc_trim in this C library")


def resident_kib() -> int:
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0])


def test_a_trim_returns_freed_pages_that_a_live_block_above_them_pins() -> None:
    # 64 MiB in blocks of 4 KiB from the C library's heap (over pymalloc's 512 B), one in 64
    # kept: the pages of the others are free, but each run of them lies below a live block,
    # so the heap's top cannot shrink past it and free() alone keeps them resident
    blocks = [bytearray(4096) for _ in range(16384)]
    kept = blocks[::64]
    del blocks
    before = resident_kib()
    assert heap.trim()
    after = resident_kib()
    assert before - after > 32 * 1024, (before, after)  # most of the 63/64 freed went back
    assert len(kept) == 256


async def test_the_timer_trims_until_it_is_cancelled() -> None:
    task = asyncio.get_running_loop().create_task(heap.trim_every(0.01))
    await asyncio.sleep(0.05)
    assert not task.done()  # trimming does not end the loop
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
