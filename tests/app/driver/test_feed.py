"""The feed between a request's loop and its attached client (``app/driver/feed.py``):
a client that waits caught up takes each new delta in the loop's own task (``direct``),
one that cannot take it so gets it, in order, in its own; and a delta offered from
outside the feed's task (``offer``: a token taken as its read arrived) is handed over
the same way."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from app.driver.feed import Feed
from app.driver.outputs import Delta, Finished, Output


class Loop:
    """A loop that yields what the test puts in, one output at a time."""

    def __init__(self) -> None:
        self.outputs: asyncio.Queue[Output] = asyncio.Queue()
        self.yielded = 0

    async def run(self) -> AsyncGenerator[Output, None]:
        while True:
            output = await self.outputs.get()
            self.yielded += 1
            yield output
            if isinstance(output, Finished):
                return


def spawn(coroutine: Any, name: str) -> asyncio.Task[Any]:
    return asyncio.get_running_loop().create_task(coroutine, name=name)


def feed_of(loop: Loop) -> Feed:
    def unattended(output: Output) -> None:
        raise AssertionError(f"no client attached for {output!r}")

    def unattended_error(error: BaseException) -> None:
        raise AssertionError(f"no client attached for {error!r}")

    return Feed(loop.run, spawn, on_unattended=unattended, on_unattended_error=unattended_error, name="loop")


def delta(text: str) -> Delta:
    return Delta(text, 0, 1, None)


async def settle(loop: Loop, yielded: int) -> None:
    """Until the loop yielded ``yielded`` outputs and every task ran as far as it can."""
    for _ in range(100):
        if loop.yielded >= yielded:
            break
        await asyncio.sleep(0)
    for _ in range(10):
        await asyncio.sleep(0)
    assert loop.yielded >= yielded


async def test_a_client_waiting_caught_up_takes_each_delta_in_the_loops_task() -> None:
    loop = Loop()
    feed = feed_of(loop)
    client = feed.attach(0)
    taken: list[tuple[str, asyncio.Task[Any] | None]] = []

    def direct(ds: list[Delta]) -> int:
        taken.extend((d.text, asyncio.current_task()) for d in ds)
        return len(ds)

    client.direct = direct
    reading = asyncio.ensure_future(anext(client))  # the client's task, waiting for an output
    for n, text in enumerate(["a", "b", "c"], start=1):
        await loop.outputs.put(delta(text))
        await settle(loop, n)
    assert [text for text, _ in taken] == ["a", "b", "c"]
    assert all(task is not None and task.get_name() == "loop" for _, task in taken)  # the loop's own task
    assert not reading.done()  # never woken for them
    assert client.cursor == 3 and [d.text for d in feed.deltas] == ["a", "b", "c"]  # kept for a later client
    await loop.outputs.put(Finished(("stop",), {}, {}))
    assert isinstance(await reading, Finished)  # anything but a delta wakes it


async def test_a_delta_the_client_cannot_take_now_waits_for_its_task_and_so_do_later_ones() -> None:
    loop = Loop()
    feed = feed_of(loop)
    client = feed.attach(0)
    offered: list[str] = []

    def direct(ds: list[Delta]) -> int:
        (d,) = ds  # the loop's task offers each delta as it comes
        offered.append(d.text)
        return int(d.text != "b")  # "b" would block (a full socket buffer)

    client.direct = direct
    reading = asyncio.ensure_future(anext(client))
    await loop.outputs.put(delta("a"))
    await loop.outputs.put(delta("b"))
    await settle(loop, 2)
    assert reading.done() and reading.result() == delta("b")  # woken with the one refused
    await loop.outputs.put(delta("c"))  # the client has not come back for more: not offered
    await settle(loop, 3)
    assert offered == ["a", "b"]
    assert client.ready_deltas(10) == [delta("c")]  # its task takes it, after "b"
    reading = asyncio.ensure_future(anext(client))  # caught up again, waiting
    await loop.outputs.put(delta("d"))
    await settle(loop, 4)
    assert offered == ["a", "b", "d"] and not reading.done()
    assert [d.text for d in feed.deltas] == ["a", "b", "c", "d"] and client.cursor == 4
    reading.cancel()
    await feed.stop()


async def test_no_delta_goes_to_a_client_without_a_direct_way_or_one_detached() -> None:
    loop = Loop()
    feed = feed_of(loop)
    client = feed.attach(0)
    reading = asyncio.ensure_future(anext(client))
    await loop.outputs.put(delta("a"))
    await settle(loop, 1)
    assert reading.result() == delta("a")  # no direct way: its task is woken, as before
    offered: list[str] = []

    def direct(ds: list[Delta]) -> int:
        offered.extend(d.text for d in ds)
        return len(ds)

    client.direct = direct
    later = feed.attach(1)  # a resumed client takes its place; the one before is detached
    reading = asyncio.ensure_future(anext(later))
    await loop.outputs.put(delta("b"))
    await settle(loop, 2)
    assert offered == [] and reading.result() == delta("b")
    await feed.stop()


async def test_a_delta_offered_from_outside_the_loops_task_is_handed_over_in_order() -> None:
    loop = Loop()
    feed = feed_of(loop)
    client = feed.attach(0)
    written: list[str] = []

    def direct(ds: list[Delta]) -> int:
        written.append("".join(d.text for d in ds))
        return len(ds)

    client.direct = direct
    reading = asyncio.ensure_future(anext(client))
    await loop.outputs.put(delta("a"))
    await settle(loop, 1)
    feed.offer([delta("b"), delta("c")])  # as the upstream connection's callback does, the loop waiting
    assert written == ["a", "bc"] and not reading.done()  # one read's deltas, in one write
    client.direct = None  # a client that cannot take it now: it is woken with it
    feed.offer([delta("d")])
    await asyncio.sleep(0)
    assert reading.done() and reading.result() == delta("d")
    assert [d.text for d in feed.deltas] == ["a", "b", "c", "d"] and client.cursor == 4
    await feed.stop()


async def test_deltas_offered_that_the_client_takes_in_part_wait_for_its_task_in_order() -> None:
    loop = Loop()
    feed = feed_of(loop)
    client = feed.attach(0)
    written: list[str] = []

    def direct(ds: list[Delta]) -> int:
        written.extend(d.text for d in ds[:1])  # the socket's buffer fills after the first
        return 1

    client.direct = direct
    reading = asyncio.ensure_future(anext(client))
    await asyncio.sleep(0)  # the client waits, caught up
    feed.offer([delta("a"), delta("b"), delta("c")])
    assert written == ["a"] and client.cursor == 1
    await asyncio.sleep(0)
    assert reading.done() and reading.result() == delta("b")  # woken with the first it did not take
    assert client.ready_deltas(10) == [delta("c")]
    assert [d.text for d in feed.deltas] == ["a", "b", "c"] and client.cursor == 3
    await feed.stop()
