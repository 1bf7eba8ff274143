"""The worker's core: admission, the frame loop, leases, cancel and drain.

How this works. ``admit`` decides synchronously, before any byte of the response, whether
an attempt starts (else a :class:`Refusal`: 4xx for the request, 429/503 for the replica).
An admitted attempt holds one of ``max_running`` engine slots or waits for one in a FIFO
queue. ``frames`` is the response body: heartbeats while queued and in prefill, then one
frame per engine output. Before every frame it checks that the attempt is not stopped
and that its lease has not lapsed (a lease timer also fires on its own, so a stalled
attempt is stopped too). ``_stop`` is the one way an attempt ends early: it marks the
attempt, so nothing more is published, and aborts the engine request in the background;
``engine_over`` is set once the engine confirmed. A cancel's answer waits for that.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from app.worker.engine import Engine, EngineFailed, EngineOutput
from app.worker.faults import Action, Fault, FaultBook, Point
from app.worker.leases import Attempt, AttemptTable, Stop
from app.worker.protocol import (
    AttemptRef,
    AttemptSpec,
    Code,
    Refusal,
    done_frame,
    error_frame,
    heartbeat_frame,
    token_frame,
    tool_call_frame,
)
from app.worker.sim import tool_call_id

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


@dataclass
class WorkerStats:
    """Counters read by /metrics at scrape time (no per-token metric calls)."""

    started: int = 0
    finished: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    stopped: dict[str, int] = field(default_factory=dict)
    lease_expiries: int = 0
    tokens_generated: int = 0
    tokens_published: int = 0
    frames_published: int = 0


def die() -> None:
    """Real process death: SIGKILL our process group if we lead one (engine children too)."""
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


class Worker:
    """The replica side of the protocol around one engine."""

    def __init__(
        self,
        engine: Engine,
        *,
        max_running: int,
        max_queued: int,
        faults: FaultBook | None = None,
        retain_s: float = 300.0,
        cancel_timeout_s: float = 30.0,
    ) -> None:
        self.engine = engine
        self.max_running = max_running
        self.max_queued = max_queued
        self.faults = faults
        self.cancel_timeout_s = cancel_timeout_s
        self.table = AttemptTable(retain_s)
        self.stats = WorkerStats()
        self.ready = False
        self.draining = False
        self.streams_open = 0
        self._running = 0
        self._waiting: deque[Attempt] = deque()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def running(self) -> int:
        return self._running

    @property
    def queued(self) -> int:
        return len(self._waiting)

    # --- admission ---------------------------------------------------------------------

    def admit(self, spec: AttemptSpec) -> Attempt:
        """Start an attempt or raise a :class:`Refusal`; nothing is sent before this returns."""
        try:
            return self._admit(spec)
        except Refusal as refusal:
            self.stats.rejected[refusal.code] = self.stats.rejected.get(refusal.code, 0) + 1
            raise

    def _admit(self, spec: AttemptSpec) -> Attempt:
        if self.draining:
            raise Refusal(503, Code.REPLICA_EXITING, "the replica is shutting down")
        if not self.ready:
            raise Refusal(503, Code.NOT_READY, "the engine is still loading", retry_after=1)
        if spec.model not in self.engine.models:
            raise Refusal(
                404, Code.UNKNOWN_MODEL, f"this worker serves {list(self.engine.models)}", field="model"
            )
        now = time.monotonic()
        to_revoke = self.table.check_start(spec, now)
        prepared = self.engine.prepare(spec)
        has_slot = self._running < self.max_running and not self._waiting
        if not has_slot and len(self._waiting) >= self.max_queued:
            raise Refusal(
                429, Code.QUEUE_FULL, f"{self.max_queued} attempts already wait here", retry_after=1
            )
        fault = self.faults.take(spec) if self.faults else None
        if fault is not None and fault.action is Action.REJECT:
            raise fault.reject()
        attempt = Attempt(spec, prepared, fault, now)
        self.table.add(attempt, now)
        for old in to_revoke:
            self._stop(old, Stop.REVOKED)
        self._arm_lease(attempt)
        if has_slot:
            self._grant(attempt)
        else:
            self._waiting.append(attempt)
        self.stats.started += 1
        return attempt

    def _grant(self, attempt: Attempt) -> None:
        self._running += 1
        attempt.has_slot = True
        attempt.slot.set_result(None)

    def _release(self, attempt: Attempt) -> None:
        """The engine is done with this attempt: free its slot for the next in line."""
        attempt.engine_over.set()
        if attempt.finished_at is None:
            attempt.finished_at = time.monotonic()
        if attempt.has_slot and not attempt.released:
            attempt.released = True
            self._running -= 1
            while self._waiting and self._running < self.max_running:
                waiting = self._waiting.popleft()
                if waiting.stop is None:
                    self._grant(waiting)

    # --- leases, stops, cancel ---------------------------------------------------------

    def _arm_lease(self, attempt: Attempt) -> None:
        if attempt.timer is not None:
            attempt.timer.cancel()
        attempt.timer = asyncio.get_running_loop().call_at(attempt.expires_at, self._lease_timer, attempt)

    def _lease_timer(self, attempt: Attempt) -> None:
        if attempt.live:
            if time.monotonic() >= attempt.expires_at:
                self._stop(attempt, Stop.LEASE_EXPIRED)
            else:
                self._arm_lease(attempt)

    def _stop(self, attempt: Attempt, reason: Stop) -> None:
        """End an attempt early: publish nothing more and abort its engine request."""
        if not attempt.live:
            return
        attempt.stop = reason
        attempt.stopped_at = time.monotonic()
        self.stats.stopped[reason] = self.stats.stopped.get(reason, 0) + 1
        if reason is Stop.LEASE_EXPIRED:
            self.stats.lease_expiries += 1
        if attempt.timer is not None:
            attempt.timer.cancel()
        if not attempt.stop_signal.done():
            attempt.stop_signal.set_result(None)
        if attempt in self._waiting:
            self._waiting.remove(attempt)
        if attempt.engine_started:
            task = asyncio.get_running_loop().create_task(self._abort(attempt))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            self._release(attempt)

    async def _abort(self, attempt: Attempt) -> None:
        try:
            attempt.engine_generated = await self.engine.abort(attempt.engine_request_id)
        except Exception:
            log.exception("engine abort failed for %s", attempt.engine_request_id)
            return  # engine_over stays unset: the abort is not confirmed
        self._release(attempt)

    def renew(self, ref: AttemptRef) -> dict[str, object]:
        """Extend an attempt's lease by ``ref.lease_ttl_s`` from now."""
        attempt = self.table.find(ref)
        if attempt is None:
            raise Refusal(404, Code.UNKNOWN_ATTEMPT, f"no attempt {ref.attempt} of {ref.request_id} here")
        now = time.monotonic()
        if attempt.live and now >= attempt.expires_at:
            self._stop(attempt, Stop.LEASE_EXPIRED)
        if attempt.stop is Stop.LEASE_EXPIRED:
            raise Refusal(410, Code.LEASE_EXPIRED, "the lease lapsed; the attempt was aborted")
        if attempt.stop is Stop.REPLICA_EXITING:
            raise Refusal(503, Code.REPLICA_EXITING, "the attempt was ended by the replica's shutdown")
        if attempt.stop is not None:
            code = Code.ATTEMPT_CANCELLED if attempt.stop is Stop.CANCELLED else Code.LEASE_REVOKED
            if attempt.stop not in (Stop.CANCELLED, Stop.REVOKED):
                code = Code.ATTEMPT_ENDED
            raise Refusal(409, code, f"the attempt ended early ({attempt.stop.value})")
        assert ref.lease_ttl_s is not None
        if attempt.phase != "done":
            attempt.expires_at = now + ref.lease_ttl_s
            self._arm_lease(attempt)
        return {
            "lease_epoch": attempt.lease_epoch,
            "lease_ttl_ms": round(ref.lease_ttl_s * 1000),
            "phase": attempt.phase,
        }

    async def cancel(self, ref: AttemptRef) -> dict[str, object]:
        """Stop an attempt; return only once the engine confirmed the abort."""
        attempt = self.table.find(ref)
        now = time.monotonic()
        if attempt is None:
            self.table.tombstone(ref, now)
            return {"state": "never_started", "generated_tokens": 0, "stop": None}
        if attempt.phase == "done":
            return {"state": "finished", "generated_tokens": attempt.generated(), "stop": None}
        self._stop(attempt, Stop.CANCELLED)
        if not await self._confirmed(attempt):
            raise Refusal(504, Code.ABORT_UNCONFIRMED, "the engine has not confirmed the abort")
        assert attempt.stop is not None
        return {"state": "aborted", "generated_tokens": attempt.generated(), "stop": attempt.stop.value}

    async def drain(self, grace_s: float) -> None:
        """SIGTERM: refuse new attempts, let live ones finish for ``grace_s``, then end the rest."""
        self.draining = True
        deadline = time.monotonic() + grace_s
        while self.table.live() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for attempt in self.table.live():
            self._stop(attempt, Stop.REPLICA_EXITING)
        deadline = time.monotonic() + 5.0
        while self.streams_open and time.monotonic() < deadline:  # let their last frames go out
            await asyncio.sleep(0.02)

    def prune(self) -> None:
        self.table.prune(time.monotonic())

    # --- the frame loop ----------------------------------------------------------------

    async def frames(self, attempt: Attempt) -> AsyncIterator[bytes]:
        """The response body of a started attempt (see the module docstring)."""
        self.streams_open += 1
        outputs: AsyncIterator[EngineOutput] | None = None
        pending: asyncio.Task[EngineOutput] | None = None
        silent = False  # a stall publishes nothing, not even its end
        try:
            heartbeat_s = attempt.spec.heartbeat_s
            while not attempt.has_slot and self._may_publish(attempt):
                yield heartbeat_frame("queued", self._position(attempt))
                await asyncio.wait(
                    (attempt.slot, attempt.stop_signal), timeout=heartbeat_s * 0.9, return_when=FIRST
                )
            fault = attempt.fault
            if self._may_publish(attempt):
                attempt.phase = "prefill"
                yield heartbeat_frame("prefill", None)
                if fault is not None:
                    async for frame in self._prefill_fault(attempt, fault):
                        yield frame
                if self._may_publish(attempt):
                    outputs = self.engine.generate(attempt.engine_request_id, attempt.prepared)
                    attempt.engine_started = True
                    pending = asyncio.ensure_future(anext(outputs))
                    while self._may_publish(attempt):
                        done, _ = await asyncio.wait(
                            (pending, attempt.stop_signal), timeout=heartbeat_s * 0.9, return_when=FIRST
                        )
                        if pending in done or not self._may_publish(attempt):
                            break
                        yield heartbeat_frame("prefill", None)
            if pending is not None and pending.done() and attempt.stop is None:
                assert outputs is not None
                first = pending.result()  # may raise EngineFailed or StopAsyncIteration
                pending = None
                attempt.phase = "decode"
                async for frame in self._decode(attempt, first, outputs):
                    if frame is None:
                        silent = True
                        break
                    yield frame
            if attempt.stop is not None and not silent:
                await self._confirmed(attempt)
                code = _STOP_CODES.get(attempt.stop)
                if code is not None:
                    yield error_frame(code, _STOP_MESSAGES[attempt.stop], attempt.generated())
        except Exception as exc:  # the engine's failure on this request, not ours: report it
            log.error("engine failed on %s: %r", attempt.engine_request_id, exc)
            self._stop(attempt, Stop.ENGINE_ERROR)
            await self._confirmed(attempt)
            yield error_frame(Code.ENGINE_ERROR, f"the engine failed: {exc!r}", attempt.generated())
        finally:
            self.streams_open -= 1
            if attempt.live:
                self._stop(attempt, Stop.DISCONNECTED)
            if pending is not None and not pending.done():
                pending.cancel()
                await asyncio.wait((pending,))  # the engine stream is free to close only then
            if outputs is not None:
                await outputs.aclose()  # type: ignore[attr-defined]

    async def _confirmed(self, attempt: Attempt) -> bool:
        """Wait (a bounded time) for the engine to confirm the attempt's abort."""
        try:
            await asyncio.wait_for(attempt.engine_over.wait(), self.cancel_timeout_s)
        except TimeoutError:
            return False
        return True

    def _may_publish(self, attempt: Attempt) -> bool:
        if attempt.stop is not None:
            return False
        if time.monotonic() >= attempt.expires_at:
            self._stop(attempt, Stop.LEASE_EXPIRED)
            return False
        return True

    def _position(self, attempt: Attempt) -> int:
        try:
            return self._waiting.index(attempt) + 1
        except ValueError:
            return 0

    async def _prefill_fault(self, attempt: Attempt, fault: Fault) -> AsyncIterator[bytes]:
        """Faults before the engine starts: die in prefill, or a long prefill, heartbeating."""
        if fault.action is Action.DIE and fault.point is Point.PREFILL:
            await asyncio.sleep(0.02)  # the prefill heartbeat leaves first
            die()
        if fault.action is Action.SLOW_PREFILL:
            interval = attempt.spec.heartbeat_s * 0.9
            until = time.monotonic() + fault.prefill_ms / 1000
            while (left := until - time.monotonic()) > 0:
                await asyncio.wait((attempt.stop_signal,), timeout=min(interval, left))
                if not self._may_publish(attempt) or time.monotonic() >= until:
                    return
                yield heartbeat_frame("prefill", None)

    async def _decode(
        self, attempt: Attempt, output: EngineOutput, outputs: AsyncIterator[EngineOutput]
    ) -> AsyncIterator[bytes | None]:
        """Frames for engine outputs; ``None`` means 'stalled: end without a word'."""
        n = attempt.spec.sampling.n
        finish_reasons: list[str | None] = [None] * n
        next_index = [0] * n
        unfinished = n
        fault = attempt.fault
        fault_at = fault.at_token if fault is not None else -1
        stats = self.stats
        monotonic = time.monotonic
        until_yield = _YIELD_EVERY
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
                self._stop(attempt, Stop.LEASE_EXPIRED)
                return
            attempt.last_frame_at = now
            choice = output.choice
            die_after = False
            if output.tool_call is not None:
                call = output.tool_call
                frame = tool_call_frame(choice, call.index, call.tool_call_id, call.name, call.arguments)
            elif token_count or output.text:
                if attempt.published_tokens == fault_at:
                    assert fault is not None
                    action = fault.action
                    if action is Action.DIE:
                        if fault.point is Point.BEFORE_FRAME:
                            die()
                        die_after = fault.point is Point.AFTER_FRAME
                    elif action is Action.STALL:
                        # cancel, lease expiry or drain ends it (wait(), not await: a
                        # cancelled reader must not cancel the shared signal)
                        await asyncio.wait((attempt.stop_signal,))
                        yield None
                        return
                    elif action is Action.MALFORMED_FRAME:
                        yield _MALFORMED_FRAME
                        if not self._may_publish(attempt):
                            return
                    elif action is Action.CLOSE_WITHOUT_DONE:
                        self._stop(attempt, Stop.FAULT)
                        return
                    elif action is Action.TOOL_CALL_THEN_DIE:
                        call_id = tool_call_id(attempt.spec.request_id, 0, 0)
                        yield tool_call_frame(0, 0, call_id, fault.tool_name, fault.tool_arguments)
                        await asyncio.sleep(0.02)  # let the frame leave
                        die()
                frame = token_frame(choice, next_index[choice], output.text, output.token_ids)
                next_index[choice] += 1
                attempt.published_tokens += 1
                stats.tokens_published += token_count
            else:
                frame = None
            if output.finish_reason is not None and finish_reasons[choice] is None:
                finish_reasons[choice] = output.finish_reason
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
        self._release(attempt)
        if fault is not None and fault.action is Action.CLOSE_WITHOUT_DONE:
            self._stop(attempt, Stop.FAULT)
        if not self._may_publish(attempt):
            return
        attempt.phase = "done"
        stats.finished += 1
        usage = {
            "prompt_tokens": attempt.prepared.prompt_tokens,
            "completion_tokens": attempt.generated_tokens,
            "total_tokens": attempt.prepared.prompt_tokens + attempt.generated_tokens,
        }
        yield done_frame([r or "stop" for r in finish_reasons], usage)
