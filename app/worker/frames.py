"""The frame loop: the response body of one started attempt.

How this works. Heartbeats while the attempt waits for a slot (``queued``, with its
position) and while the engine prefills; then one frame per engine output. Before every
frame the lease is checked (``may_publish``, or inline on the token path) and a
stopped attempt publishes nothing more. When the loop ends early it waits for the engine
to confirm the abort, then writes the one ``error`` frame that says why. Scripted faults
act at their token here. The per-token path is kept to a few attribute reads, one
``time.monotonic()`` and one ``bytes`` formatting.

The loop reaches the worker that admitted the attempt only through :class:`AttemptHost`,
so this module imports nothing from the worker's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Protocol

from app.worker.attempt import Attempt, Stop
from app.worker.engine import Engine, EngineFailed, EngineOutput, PooledOutput
from app.worker.faults import Fault, FaultAction, Point
from app.worker.frame_encoders import (
    done_frame,
    error_frame,
    heartbeat_frame,
    prompt_logprobs_frame,
    token_frame,
    tool_call_frame,
    with_prompt_tokens,
)
from app.worker.protocol import Code
from app.worker.sim import tool_call_id
from app.worker.stats import WorkerStats

log = logging.getLogger("phasegate.worker")
FIRST = asyncio.FIRST_COMPLETED

_STOP_CODES = {
    Stop.CANCELLED: Code.CANCELLED,
    Stop.LEASE_EXPIRED: Code.LEASE_EXPIRED,
    Stop.REVOKED: Code.LEASE_REVOKED,
    Stop.REPLICA_EXITING: Code.REPLICA_EXITING,
    Stop.ENGINE_ERROR: Code.ENGINE_ERROR,
}
_STOP_MESSAGES = {
    Stop.CANCELLED: "the attempt was cancelled",
    Stop.LEASE_EXPIRED: "the attempt's lease lapsed unrenewed",
    Stop.REVOKED: "a newer lease epoch for this request started here",
    Stop.REPLICA_EXITING: "the replica is shutting down",
    Stop.ENGINE_ERROR: "the engine failed on this request",
}
_YIELD_EVERY = 16
_MALFORMED_FRAME = b'{"type":"token","choice":0,"index":\n'


class AttemptHost(Protocol):
    """What the frame loop needs from the worker that admitted the attempt."""

    engine: Engine
    stats: WorkerStats
    streams_open: int  # response bodies being written, for the drain

    def may_publish(self, attempt: Attempt) -> bool:
        """The check before a frame: not stopped and the lease not lapsed (else stop it now)."""
        ...

    def queue_position(self, attempt: Attempt) -> int:
        """1 for the next in line; 0 once it holds a slot."""
        ...

    def stop(self, attempt: Attempt, reason: Stop) -> None:
        """End an attempt early: publish nothing more and abort its engine request."""
        ...

    async def confirmed(self, attempt: Attempt) -> bool:
        """Wait (a bounded time) for the engine to confirm the attempt's abort."""
        ...

    def release(self, attempt: Attempt) -> None:
        """The engine is done with this attempt: free its slot for the next in line."""
        ...


def die() -> None:
    """Real process death: SIGKILL our process group if we lead one (engine children too)."""
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


async def frames(worker: AttemptHost, attempt: Attempt) -> AsyncIterator[bytes]:
    """The response body of a started attempt (see the module docstring)."""
    worker.streams_open += 1
    outputs: AsyncIterator[EngineOutput] | None = None
    pending: asyncio.Task[EngineOutput] | None = None
    silent = False  # a stall publishes nothing, not even its end
    try:
        heartbeat_s = attempt.spec.heartbeat_s
        while not attempt.has_slot and worker.may_publish(attempt):
            yield heartbeat_frame("queued", worker.queue_position(attempt))
            await asyncio.wait((attempt.slot, attempt.stop_signal), timeout=heartbeat_s * 0.9, return_when=FIRST)
        fault = attempt.fault
        if worker.may_publish(attempt):
            attempt.phase = "prefill"
            yield heartbeat_frame("prefill", None)
            if fault is not None:
                async for frame in _prefill_fault(worker, attempt, fault):
                    yield frame
            if worker.may_publish(attempt):
                outputs = worker.engine.generate(attempt.engine_request_id, attempt.prepared)
                attempt.engine_started = True
                pending = asyncio.ensure_future(anext(outputs))
                while worker.may_publish(attempt):
                    done, _ = await asyncio.wait(
                        (pending, attempt.stop_signal), timeout=heartbeat_s * 0.9, return_when=FIRST
                    )
                    if pending in done or not worker.may_publish(attempt):
                        break
                    yield heartbeat_frame("prefill", None)
        if pending is not None and pending.done() and attempt.stop is None:
            assert outputs is not None
            first = pending.result()  # may raise EngineFailed or StopAsyncIteration
            pending = None
            attempt.phase = "decode"
            async with contextlib.aclosing(_decode(worker, attempt, first, outputs)) as decoded:
                async for token_frame_or_none in decoded:
                    if token_frame_or_none is None:
                        silent = True
                        break
                    yield token_frame_or_none
        if attempt.stop is not None and not silent:
            await worker.confirmed(attempt)
            code = _STOP_CODES.get(attempt.stop)
            if code is not None:
                yield error_frame(code, _STOP_MESSAGES[attempt.stop], attempt.generated())
    except Exception as exc:  # the engine's failure on this request, not ours: report it
        log.error("engine failed on %s: %r", attempt.engine_request_id, exc)
        worker.stop(attempt, Stop.ENGINE_ERROR)
        await worker.confirmed(attempt)
        yield error_frame(Code.ENGINE_ERROR, f"the engine failed: {exc!r}", attempt.generated())
    finally:
        worker.streams_open -= 1
        if attempt.live:
            worker.stop(attempt, Stop.DISCONNECTED)
        if pending is not None and not pending.done():
            pending.cancel()
            await asyncio.wait((pending,))  # the engine stream is free to close only then
        if outputs is not None:
            await outputs.aclose()  # type: ignore[attr-defined]


async def _prefill_fault(worker: AttemptHost, attempt: Attempt, fault: Fault) -> AsyncIterator[bytes]:
    """Faults before the engine starts: die in prefill, fail as an engine would (the caller
    turns the :class:`EngineFailed` into an ``engine_error`` frame), or a long prefill."""
    if fault.action is FaultAction.ENGINE_ERROR:
        raise EngineFailed(f"injected fault {fault.id}: the engine failed on this request")
    if fault.action is FaultAction.DIE and fault.point is Point.PREFILL:
        await asyncio.sleep(0.02)  # the prefill heartbeat leaves first
        die()
    if fault.action is FaultAction.SLOW_PREFILL:
        interval = attempt.spec.heartbeat_s * 0.9
        until = time.monotonic() + fault.prefill_ms / 1000
        while (left := until - time.monotonic()) > 0:
            await asyncio.wait((attempt.stop_signal,), timeout=min(interval, left))
            if not worker.may_publish(attempt) or time.monotonic() >= until:
                return
            yield heartbeat_frame("prefill", None)


async def _decode(
    worker: AttemptHost, attempt: Attempt, output: EngineOutput, outputs: AsyncIterator[EngineOutput]
) -> AsyncGenerator[bytes | None, None]:
    """Frames for engine outputs; ``None`` means 'stalled: end without a word'."""
    n = attempt.spec.choices
    finish_reasons: list[str | None] = [None] * n
    stop_reasons: list[str | int | None] = [None] * n
    next_index = [0] * n
    unfinished = n
    fault = attempt.fault
    fault_at = fault.at_token if fault is not None else -1
    stats = worker.stats
    monotonic = time.monotonic
    until_yield = _YIELD_EVERY
    answer = output.answer  # a pooling request's: its one output carries it
    while True:
        until_yield -= 1
        if not until_yield:
            # buffered engine outputs and socket writes never suspend: let renewals,
            # cancels and lease timers in now and then
            until_yield = _YIELD_EVERY
            await asyncio.sleep(0)
        token_count = len(output.token_ids)
        attempt.generated_tokens += token_count
        stats.tokens_generated += token_count
        if attempt.stop is not None:
            return
        now = monotonic()
        if now >= attempt.expires_at:
            worker.stop(attempt, Stop.LEASE_EXPIRED)
            return
        attempt.last_frame_at = now
        choice = output.choice
        die_after = False
        if output.tool_call is not None:
            call = output.tool_call
            frame = tool_call_frame(
                choice, call.index, call.tool_call_id, call.name, call.arguments, streamed=call.streamed
            )
            # the engine's own tool call, reached after k tokens: publish it, then die
            tool_fault = fault is not None and fault.action is FaultAction.TOOL_CALL_THEN_DIE
            die_after = tool_fault and fault_at == attempt.published_tokens
        elif token_count or output.text:
            if attempt.published_tokens == fault_at:  # the one check a token makes of the fault
                assert fault is not None
                step = _FaultStep()
                async for faulted in _token_fault(worker, attempt, fault, step):
                    yield faulted
                if step.ends:
                    return
                die_after = step.die_after
                fault_at = fault.at_token  # a hold's release may have moved it on
            frame = token_frame(
                choice, next_index[choice], output.text, output.token_ids, output.logprobs, output.key, output.prompt
            )
            frame = _prompt_said(frame, attempt, output) if attempt.counts_due or output.prompt_logprobs else frame
            next_index[choice] += 1
            attempt.published_tokens += 1
            stats.tokens_published += token_count
        else:
            frame = None
        if output.finish_reason is not None and finish_reasons[choice] is None:
            finish_reasons[choice] = output.finish_reason
            stop_reasons[choice] = output.stop_reason
            unfinished -= 1
        if frame is not None:
            stats.frames_published += 1
            yield frame
            if die_after:
                await asyncio.sleep(0.02)  # let the frame leave
                die()
        if not unfinished:
            break
        try:
            output = await anext(outputs)
        except StopAsyncIteration:
            raise EngineFailed("the engine ended the request without a finish reason") from None
    done = _finished(worker, attempt, finish_reasons, stop_reasons, answer)
    if done is not None:
        yield done


def _prompt_said(frame: bytes, attempt: Attempt, output: EngineOutput) -> bytes:
    """What a choice's first token frame says of the prompt: the prompt's log probabilities
    in a frame before it, where the engine said them with it (the start asked); and its
    token count, where the client asked (``Attempt.counts_due``)."""
    if output.prompt_logprobs is not None:
        frame = prompt_logprobs_frame(output.choice, output.prompt_logprobs) + frame
    return _prompt_counted(frame, attempt, output) if attempt.counts_due else frame


def _prompt_counted(frame: bytes, attempt: Attempt, output: EngineOutput) -> bytes:
    """A choice's first token frame with text (or log probabilities: one that carries a
    delta) says the prompt's token count, where the client asked (``Attempt.counts_due``)."""
    due, choice = attempt.counts_due, output.choice
    if not due or choice not in due or not (output.text or output.logprobs is not None):
        return frame
    due.discard(choice)
    return with_prompt_tokens(frame, attempt.prepared.prompt_tokens_of(choice))


def _finished(
    worker: AttemptHost,
    attempt: Attempt,
    finish_reasons: list[str | None],
    stop_reasons: list[str | int | None],
    answer: PooledOutput | None,
) -> bytes | None:
    """The attempt's ``done`` frame once every choice finished; ``None`` where it may no
    longer publish (or a fault closes it without one)."""
    worker.release(attempt)
    fault = attempt.fault
    if fault is not None and fault.action is FaultAction.CLOSE_WITHOUT_DONE:
        worker.stop(attempt, Stop.FAULT)
    if not worker.may_publish(attempt):
        return None
    attempt.phase = "done"
    worker.stats.finished += 1
    usage = {
        "prompt_tokens": attempt.prepared.prompt_tokens,
        "completion_tokens": attempt.generated_tokens,
        "total_tokens": attempt.prepared.prompt_tokens + attempt.generated_tokens,
    }
    details = attempt.prepared.usage_details() if attempt.prepared.usage_details is not None else None
    return done_frame([r or "stop" for r in finish_reasons], {**usage, **(details or {})}, stop_reasons, answer)


class _FaultStep:
    """What the fault at a token left to do: end the frames, or die after this token's."""

    ends = False
    die_after = False


async def _token_fault(
    worker: AttemptHost, attempt: Attempt, fault: Fault, step: _FaultStep
) -> AsyncGenerator[bytes | None, None]:
    """The fault's action at the token it names (its frames, ``None`` for a stall); what
    is left to do goes in ``step``."""
    action = fault.action
    if action is FaultAction.DIE:
        if fault.point is Point.BEFORE_FRAME:
            die()
        step.die_after = fault.point is Point.AFTER_FRAME
    elif action is FaultAction.STALL:
        # cancel, lease expiry or drain ends it (wait(), not await: a
        # cancelled reader must not cancel the shared signal)
        await asyncio.wait((attempt.stop_signal,))
        yield None
        step.ends = True
    elif action is FaultAction.HOLD:
        # until the test releases it; cancel, lease expiry or drain end it as a stall's
        released = asyncio.ensure_future(fault.released.wait())
        await asyncio.wait((attempt.stop_signal, released), return_when=FIRST)
        released.cancel()
        step.ends = attempt.stop is not None
    elif action is FaultAction.MALFORMED_FRAME:
        yield _MALFORMED_FRAME
        step.ends = not worker.may_publish(attempt)
    elif action is FaultAction.CLOSE_WITHOUT_DONE:
        worker.stop(attempt, Stop.FAULT)
        step.ends = True
    elif action is FaultAction.TOOL_CALL_THEN_DIE:
        call_id = tool_call_id(attempt.spec.request_id, 0, 0)
        yield tool_call_frame(0, 0, call_id, fault.tool_name, fault.tool_arguments)
        await asyncio.sleep(0.02)  # let the frame leave
        die()
