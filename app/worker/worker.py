"""The worker's core: admission, engine slots, leases, stops, cancel and drain.

How this works. ``admit`` decides, before any byte of the response, whether an attempt
starts (else a :class:`Refusal`: 4xx for the request, 429/503 for the replica): the
engine prepares it first (which may wait: vLLM's pooling servers render in a thread), then
the fencing checks, the queue and the table are decided at once, with no wait between.
An admitted attempt holds one of ``max_running`` engine slots or waits for one in a FIFO
queue; its response body is the frame loop of ``frames.py``. Each attempt has a lease
timer that stops it when the lease lapses, even if it publishes nothing (a stall).
``stop`` is the one way an attempt ends early: it marks the attempt, so nothing more is
published, and aborts the engine request in the background; ``engine_over`` is set once
the engine confirmed. A cancel's answer waits for that.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator

from app.worker.attempt import Attempt, AttemptTable, Stop
from app.worker.engine import Engine, Prepared
from app.worker.faults import FaultAction, FaultBook
from app.worker.frames import frames
from app.worker.lease_calls import AttemptRef
from app.worker.protocol import AttemptSpec, Code, Refusal
from app.worker.stats import WorkerStats

log = logging.getLogger("phasegate.worker")


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

    async def admit(self, spec: AttemptSpec) -> Attempt:
        """Start an attempt or raise a :class:`Refusal`; nothing is sent before this returns."""
        try:
            self._servable(spec)
            prepared = await self.engine.prepare(spec)
            attempt = self._admit(spec, prepared)
        except Refusal as refusal:
            self.stats.rejected[refusal.code] = self.stats.rejected.get(refusal.code, 0) + 1
            log.info("attempt refused: %d %s", refusal.status, refusal.code.value, extra=_about(spec))
            raise
        log.info("attempt admitted (%s)", "running" if attempt.has_slot else "queued", extra=_about(spec))
        return attempt

    def _servable(self, spec: AttemptSpec) -> None:
        if self.draining:
            raise Refusal(503, Code.REPLICA_EXITING, "the replica is shutting down")
        if not self.ready:
            raise Refusal(503, Code.NOT_READY, "the engine is still loading", retry_after=1)
        if spec.model not in self.engine.models:
            raise Refusal(404, Code.UNKNOWN_MODEL, f"this worker serves {list(self.engine.models)}", field="model")

    def _admit(self, spec: AttemptSpec, prepared: Prepared) -> Attempt:
        self._servable(spec)  # again: a drain may have begun while the engine prepared it
        now = time.monotonic()
        to_revoke = self.table.check_start(spec, now)
        has_slot = self._running < self.max_running and not self._waiting
        if not has_slot and len(self._waiting) >= self.max_queued:
            raise Refusal(429, Code.QUEUE_FULL, f"{self.max_queued} attempts already wait here", retry_after=1)
        fault = self.faults.take(spec) if self.faults else None
        if fault is not None and fault.action is FaultAction.REJECT:
            raise fault.reject()
        attempt = Attempt(spec, prepared, fault, now)
        self.table.add(attempt, now)
        for old in to_revoke:
            self.stop(old, Stop.REVOKED)
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

    def release(self, attempt: Attempt) -> None:
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
        # call_later, not call_at: the loop's clock need not be time.monotonic() (uvloop's is not)
        delay = attempt.expires_at - time.monotonic()
        attempt.timer = asyncio.get_running_loop().call_later(delay, self._lease_timer, attempt)

    def _lease_timer(self, attempt: Attempt) -> None:
        if attempt.live:
            if time.monotonic() >= attempt.expires_at:
                self.stop(attempt, Stop.LEASE_EXPIRED)
            else:
                self._arm_lease(attempt)

    def stop(self, attempt: Attempt, reason: Stop) -> None:
        """End an attempt early: publish nothing more and abort its engine request."""
        if not attempt.live:
            return
        attempt.stop = reason
        attempt.stopped_at = time.monotonic()
        log.info("attempt stopped early: %s", reason.value, extra=_about(attempt.spec))
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
            self.release(attempt)

    async def _abort(self, attempt: Attempt) -> None:
        try:
            counted = await self.engine.abort(attempt.engine_request_id)
        except Exception:
            log.exception("engine abort failed for %s", attempt.engine_request_id, extra=_about(attempt.spec))
            return  # engine_over stays unset: the abort is not confirmed
        attempt.engine_generated = max(counted or 0, attempt.generated_tokens)
        self.release(attempt)

    def renew(self, ref: AttemptRef) -> dict[str, object]:
        """Extend an attempt's lease by ``ref.lease_ttl_s`` from now, as far as the last
        answered renewal allows (:meth:`Attempt.renewed_until`); the answer says how long
        it now runs (``lease_ttl_ms``)."""
        attempt = self.table.find(ref)
        if attempt is None:
            raise Refusal(404, Code.UNKNOWN_ATTEMPT, f"no attempt {ref.attempt} of {ref.request_id} here")
        now = time.monotonic()
        if attempt.live and now >= attempt.expires_at:
            self.stop(attempt, Stop.LEASE_EXPIRED)
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
        self.stats.leases_renewed += 1
        if attempt.phase != "done":
            attempt.expires_at = attempt.renewed_until(ref, now)
            self._arm_lease(attempt)
        return {
            "lease_epoch": attempt.lease_epoch,
            "lease_ttl_ms": max(round((attempt.expires_at - now) * 1000), 0),
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
        self.stop(attempt, Stop.CANCELLED)
        if not await self.confirmed(attempt):
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
            self.stop(attempt, Stop.REPLICA_EXITING)
        deadline = time.monotonic() + 5.0
        while self.streams_open and time.monotonic() < deadline:  # let their last frames go out
            await asyncio.sleep(0.02)

    def prune(self) -> None:
        self.table.prune(time.monotonic())

    # --- for the frame loop ------------------------------------------------------------

    async def confirmed(self, attempt: Attempt) -> bool:
        """Wait (a bounded time) for the engine to confirm the attempt's abort."""
        try:
            await asyncio.wait_for(attempt.engine_over.wait(), self.cancel_timeout_s)
        except TimeoutError:
            return False
        return True

    def may_publish(self, attempt: Attempt) -> bool:
        """The check before a frame: not stopped and the lease not lapsed (else stop it now)."""
        if attempt.stop is not None:
            return False
        if time.monotonic() >= attempt.expires_at:
            self.stop(attempt, Stop.LEASE_EXPIRED)
            return False
        return True

    def queue_position(self, attempt: Attempt) -> int:
        """1 for the next in line; 0 once it holds a slot."""
        try:
            return self._waiting.index(attempt) + 1
        except ValueError:
            return 0

    def frames(self, attempt: Attempt) -> AsyncIterator[bytes]:
        """The response body of a started attempt (see frames.py)."""
        return frames(self, attempt)


def _about(spec: AttemptSpec | AttemptRef) -> dict[str, object]:
    """What a line about this attempt is about (its stop may come from a timer, with nothing bound)."""
    return {"request_id": spec.request_id, "attempt": spec.attempt}
