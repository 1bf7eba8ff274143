"""The stall deadline of an attempt's reads (``app/driver/attempt.py``'s ``_StallWatch``)."""

from __future__ import annotations

import asyncio
import contextlib
import time

from app.driver.attempt import _StallWatch


async def read(watch: _StallWatch, limit: float, arrives: asyncio.Future[str]) -> str:
    """A read as ``AttemptRun.next_frame`` does it: the frame, or ``"stalled"``."""
    watch.reading(limit)
    try:
        frame = await arrives
    except asyncio.CancelledError:
        if watch.read_ended():
            return "stalled"
        raise
    watch.read_ended()
    return frame


async def test_a_read_past_its_deadline_is_a_stall() -> None:
    watch = _StallWatch()
    never: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    began = time.monotonic()
    assert await read(watch, 0.05, never) == "stalled"
    assert 0.04 < time.monotonic() - began < 1.0
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
    watch.stop()


async def test_reads_that_keep_coming_never_stall() -> None:
    watch = _StallWatch()
    loop = asyncio.get_running_loop()
    for n in range(8):  # 8 reads of 20 ms under a 50 ms deadline: 160 ms in all
        frame: asyncio.Future[str] = loop.create_future()
        loop.call_later(0.02, frame.set_result, f"frame {n}")
        assert await read(watch, 0.05, frame) == f"frame {n}"
    watch.stop()


async def test_a_loop_that_ran_late_does_not_fail_a_frame_waiting_to_be_read() -> None:
    """The gateway was busy past the deadline while the frame came: the frame is read."""
    watch = _StallWatch()
    loop = asyncio.get_running_loop()
    frame: asyncio.Future[str] = loop.create_future()

    def busy() -> None:
        time.sleep(0.3)  # the loop runs nothing else meanwhile; the frame is read after
        loop.call_soon(frame.set_result, "frame")

    loop.call_later(0.01, busy)
    assert await read(watch, 0.05, frame) == "frame"
    watch.stop()


async def test_another_cancel_of_the_read_goes_on_as_a_cancel() -> None:
    watch = _StallWatch()
    loop = asyncio.get_running_loop()
    never: asyncio.Future[str] = loop.create_future()
    task = asyncio.ensure_future(read(watch, 60.0, never))
    await asyncio.sleep(0.01)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert task.cancelled()
    watch.stop()
