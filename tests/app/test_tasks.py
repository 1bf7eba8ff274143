"""app/tasks.py: a background loop ends though Python 3.11's ``asyncio.wait_for`` drops a
cancellation that arrives together with its result (a gateway whose DNS loop went on
after its cancel, dnspython reading each answer through ``wait_for``, never stopped)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from app.tasks import ended


class Loop:
    """A loop around ``asyncio.wait_for``, as a resolver's or the fleet keeper's is; ``answer``
    completes its wait in the same step as a cancel, as a DNS answer can."""

    def __init__(self) -> None:
        self.turns = 0
        self.waiting: asyncio.Future[int] | None = None

    async def run(self) -> None:
        while True:
            self.waiting = asyncio.get_running_loop().create_future()
            await asyncio.wait_for(self.waiting, 10)
            self.turns += 1

    async def started(self) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(self.run())
        while self.waiting is None:
            await asyncio.sleep(0)
        return task

    def answer_and_cancel(self, task: asyncio.Task[None]) -> None:
        assert self.waiting is not None
        self.waiting.set_result(1)
        task.cancel()


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="3.12's wait_for keeps the cancellation")
async def test_one_cancel_that_meets_an_answer_does_not_end_the_loop() -> None:
    """What the helper is for: the cancel is dropped and the loop turns on."""
    loop = Loop()
    task = await loop.started()
    loop.answer_and_cancel(task)
    done, _ = await asyncio.wait({task}, timeout=0.2)
    assert not done and loop.turns == 1
    await ended(task)


async def test_ended_ends_a_loop_whose_cancel_met_an_answer() -> None:
    loop = Loop()
    task = await loop.started()
    loop.answer_and_cancel(task)
    await asyncio.wait_for(ended(task), 5)
    assert task.done() and task.cancelled()


async def test_ended_takes_none_and_tasks_that_already_ended() -> None:
    async def fails() -> None:
        raise ValueError("its own fault")

    failed = asyncio.get_running_loop().create_task(fails())
    await asyncio.wait({failed})
    quiet = asyncio.get_running_loop().create_task(asyncio.sleep(10))
    await ended(None, failed, quiet)
    assert quiet.cancelled()
    assert isinstance(failed.exception(), ValueError)  # still the task's to tell, not raised here
