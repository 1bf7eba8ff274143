"""An engine task that dies ends its attempt at once, with a terminal frame.

The bad tool schema below can no longer reach the engine through the protocol (the parser
refuses it), so these tests build the attempt in process, as a parser bug would let it
through, and run the real sim engine and the real worker frame loop on it.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from app.worker.engine import EngineFailed
from app.worker.protocol import AttemptSpec, Sampling
from app.worker.sim import SimEngine, SimTiming
from app.worker.worker import Worker

BROKEN_TOOLS = ({"type": "function", "function": {"name": "f", "parameters": "not a schema"}},)


def broken_spec(request_id: str = "r-broken") -> AttemptSpec:
    sampling = Sampling(max_tokens=8, tools=BROKEN_TOOLS, tool_choice="auto")
    return AttemptSpec(request_id, 1, 1, 5.0, "sim", None, "hello", sampling, 0.05)


async def test_the_sim_engine_ends_a_request_whose_task_died_with_engine_failed() -> None:
    engine = SimEngine(timing=SimTiming(0.0001, 0.001, 0.0))
    started = time.monotonic()
    with pytest.raises(EngineFailed, match="the sim failed on this request"):
        async with asyncio.timeout(2):
            async for _ in engine.generate("e1", await engine.prepare(broken_spec())):
                pass
    assert time.monotonic() - started < 1.0
    await asyncio.sleep(0)  # the task's done callback
    assert engine._running == {}  # nothing left behind


async def test_the_worker_fails_the_attempt_at_once_with_an_error_frame() -> None:
    worker = Worker(SimEngine(timing=SimTiming(0.0001, 0.001, 0.0)), max_running=1, max_queued=1)
    worker.ready = True
    attempt = await worker.admit(broken_spec())
    started = time.monotonic()
    async with asyncio.timeout(3):  # heartbeats every 50 ms: a hang would run into this
        frames = [json.loads(frame) async for frame in worker.frames(attempt)]
    assert time.monotonic() - started < 1.0
    assert [f["type"] for f in frames] == ["heartbeat", "error"]
    assert frames[-1]["code"] == "engine_error"
    # the slot is free again: a good attempt runs next
    good = await worker.admit(AttemptSpec("r-good", 1, 1, 5.0, "sim", None, "hi", Sampling(max_tokens=3), 0.05))
    async with asyncio.timeout(3):
        assert [json.loads(f) async for f in worker.frames(good)][-1]["type"] == "done"
