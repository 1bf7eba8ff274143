"""The vLLM engine's output streams put together: a batch's streams merged into one, and
each choice's first output given what is said of its prompt (app/worker/vllm_engine.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from app.worker.engine import EngineOutput


async def merged(
    streams: list[AsyncGenerator[EngineOutput, None]], ended: Callable[[], object]
) -> AsyncGenerator[EngineOutput, None]:
    """A batch's streams as one, each output as it comes; all closed when it is (each
    engine request aborted then), and ``ended`` called."""
    queue: asyncio.Queue[EngineOutput | BaseException | None] = asyncio.Queue()

    async def pump(stream: AsyncGenerator[EngineOutput, None]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for output in stream:
                    queue.put_nowait(output)
            queue.put_nowait(None)
        except Exception as exc:
            queue.put_nowait(exc)

    tasks = [asyncio.ensure_future(pump(stream)) for stream in streams]
    try:
        live = len(tasks)
        while live:
            got = await queue.get()
            if got is None:
                live -= 1
            elif isinstance(got, BaseException):
                raise got
            else:
                yield got
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        ended()


async def saying(
    outputs: AsyncGenerator[EngineOutput, None], said: dict[int, tuple[list[int] | None, str | None]]
) -> AsyncIterator[EngineOutput]:
    """``outputs``, each choice's first that carries a delta (text, or log probabilities)
    with what is said of its prompt; closed with them (vLLM aborts its request when its
    generator closes)."""
    async with contextlib.aclosing(outputs):
        async for output in outputs:
            if said and output.choice in said and (output.text or output.logprobs is not None):
                output.prompt = said.pop(output.choice)
            yield output
