"""The policy's actions, carried out for one request's loop (:mod:`app.driver.loop`).

Each action records its events at once, before any await, and returns what is left to
await (an append, opening a stream, waiting for a fence, a timer): a cancellation
then never finds a decision half carried out. :class:`LoopActions` is the loop's base;
the loop itself reads the frames, observes and ends the request.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from datetime import timedelta

from app.config import Timeouts
from app.driver.attempt import AttemptRun
from app.driver.charges import FailureCharges
from app.driver.context import GatewayContext
from app.driver.outcome_events import record_closed, record_failed, record_stopped
from app.driver.outputs import Cancelled, Failed, Output
from app.driver.recorder import Recorder
from app.driver.request import GenerationRequest
from app.driver.tools import ToolCalls
from app.replicas.base import Token, UpstreamFailure
from app.replicas.replica import Replica
from statemachine import events as ev
from statemachine.actions import (
    Action,
    CancelAttempt,
    CancelRequest,
    FailRequest,
    FenceAttempt,
    StartAttempt,
    WaitToRetry,
)
from statemachine.policy import POISON_REQUEST
from statemachine.request_state import FenceWait, RequestState

LEASE_EXPIRY_MARGIN_S = 0.05  # clocks differ a little: wait past the replica's expiry


class LoopActions:
    """What the policy's actions do; the loop (:class:`app.driver.loop.RequestLoop`) sets
    the fields below and gives the three methods at the end."""

    ctx: GatewayContext
    request: GenerationRequest
    timeouts: Timeouts  # as configured when the request was accepted: a reload never changes them
    recorder: Recorder
    run: AttemptRun | None
    tool_calls: ToolCalls
    charges: FailureCharges
    _restarted: bool

    @property
    def request_id(self) -> str:
        return self.recorder.request_id

    @property
    def state(self) -> RequestState:
        return self.recorder.state

    def fence_drained(self, replica: Replica) -> bool:
        run = self.run
        if run is None or run.replica is not replica or run.drained:
            return False
        run.drain()
        return True

    def _record_action(self, action: Action) -> Callable[[], Awaitable[Output | None]] | None:
        if isinstance(action, StartAttempt):
            return self._start_attempt(action)
        if isinstance(action, WaitToRetry):
            return self._wait_to_retry(action)
        if isinstance(action, FenceAttempt):
            return self._fence(action)
        if isinstance(action, CancelAttempt):
            return self._cancel_attempt()
        if isinstance(action, FailRequest):
            return self._fail(action)
        if isinstance(action, CancelRequest):
            return self._cancel_request(action)
        return None  # Wait: nothing to do but keep reading

    def _start_attempt(self, action: StartAttempt) -> Callable[[], Awaitable[Output | None]] | None:
        ctx, request = self.ctx, self.request
        if action.attempt > 1 and not ctx.budget.try_take():
            self.recorder.record(ev.RetryBudgetDenied, scope="global")
            ctx.metrics.retry_budget_denied.inc()
            return None
        replica = ctx.pool.replicas.get(action.replica) if action.replica is not None else None
        if replica is None:
            self.recorder.record(
                ev.NoReplicaAvailable,
                excluded=action.exclude_replicas,
                detail=f"no healthy replica serves {action.model or request.model}",
            )
            return None
        ctx.pool.placed(replica)
        if action.migration is not None:
            ctx.metrics.migrations.labels(model=request.model, migration_type=action.migration).inc()
        ttl = self.timeouts.lease_ttl_s
        self.recorder.record(
            ev.AttemptStarted,
            attempt=action.attempt,
            lease_epoch=action.attempt,
            replica_id=replica.id,
            lease_expires_at=ctx.wall_clock() + timedelta(seconds=ttl),
            acknowledges_cancel=replica.client.acknowledges_cancel,
            aborts_on_close=replica.client.aborts_on_close,
            model=action.model if action.model != request.model else None,
            model_revision=self._fallback_revision(action.model),
        )
        run = AttemptRun(
            replica,
            request.for_attempt(self.request_id, action.attempt, lease_ttl_s=ttl, model=action.model),
            clock=ctx.clock,
            timeouts=self.timeouts,
        )
        self.run = run
        self.tool_calls.restart()

        async def open_attempt() -> Output | None:
            # queued ahead of anything the replica's answer makes us record, so the log
            # holds the grant before the commit point; durable only with the commit point
            await self.recorder.flush(durable=False)
            try:
                await run.open()
            except UpstreamFailure as failure:
                await self._observe_failure(run, failure)
                return None
            self._restarted = action.attempt > 1
            run.offer_tokens(functools.partial(self._tokens_now, run))
            return None

        return open_attempt

    def _fallback_revision(self, model: str) -> str | None:
        """A fallback's revision, recorded with its attempt so that its retries stay on it:
        the one its first attempt pinned, else the configured one it is placed at now."""
        if not model or model == self.request.model:
            return None  # the request's own: RequestAccepted recorded it
        return self.state.revision_of(model) or self.ctx.config.model_revision(model)

    def _wait_to_retry(self, action: WaitToRetry) -> Callable[[], Awaitable[Output | None]]:
        async def wait() -> Output | None:
            # the timer: at most retry_same_max_wait_s; a drain or a stop ends the request after it
            await asyncio.sleep(action.wait_s)
            self.recorder.record(ev.RetryWaitElapsed, replica_id=action.replica)
            return None

        return wait

    def _fence(self, action: FenceAttempt) -> Callable[[], Awaitable[Output | None]]:
        run = self.run
        assert run is not None and run.attempt == action.attempt
        self.recorder.record(
            ev.AttemptFenced, attempt=run.attempt, lease_epoch=run.lease_epoch, waiting_for=action.wait_for
        )
        self.recorder.record(ev.CancelSent, attempt=run.attempt, lease_epoch=run.lease_epoch)
        self.run = None
        closing = action.wait_for is FenceWait.CONNECTION_CLOSE
        fence = self.ctx.spawn(
            self._settle(run, fenced=True, closing=closing), name=f"fence {self.request_id}/{run.attempt}"
        )
        if not action.request_waits:
            return _nothing  # the stream ends now; the fence completes as bookkeeping

        async def wait_for_fence() -> Output | None:
            await self.recorder.flush(durable=False)
            await asyncio.shield(fence)
            return None

        return wait_for_fence

    def _cancel_attempt(self) -> Callable[[], Awaitable[Output | None]] | None:
        run = self.run
        if run is None:
            return None
        self.recorder.record(ev.CancelSent, attempt=run.attempt, lease_epoch=run.lease_epoch)
        self.run = None
        self.ctx.spawn(self._settle(run, fenced=False), name=f"cancel {self.request_id}/{run.attempt}")
        return None

    async def _settle(self, run: AttemptRun, *, fenced: bool, closing: bool = False) -> None:
        """Stop the attempt for good: cancel acknowledged, or its lease run out; or,
        ``closing`` (a fence before any delivery on a replica that aborts on a closed
        connection), its stream closed, with no proof to wait for (docs/design.md §7)."""
        generated = None if closing else await run.cancel()  # before the close: the ack names the attempt
        await run.release()
        if closing:
            record_closed(self.recorder, run.attempt, run.lease_epoch)
        else:
            if generated is None:
                await asyncio.sleep(max(run.lease_expires_in, 0.0) + LEASE_EXPIRY_MARGIN_S)
            record_stopped(self.recorder, run.attempt, run.lease_epoch, generated)
        if fenced:
            released_by = "connection_close" if closing else "cancel_ack" if generated is not None else "lease_expiry"
            self.ctx.metrics.fences.labels(released_by=released_by).inc()
        await self.recorder.flush(durable=False)
        self._maybe_forget()

    def _fail(self, action: FailRequest) -> Callable[[], Awaitable[Output | None]]:
        record_failed(self.recorder, action)
        self.charges.settle(poison=action.code == POISON_REQUEST)
        model = self.request.model
        if action.code == "upstream_decode_interrupted":
            self.ctx.metrics.decode_interruptions.labels(model=model).inc()
        if action.code == "retry_cost_exceeded":
            self.ctx.metrics.cost_guard.labels(model=model).inc()

        current = self.state.current_attempt
        refused = action.reason == "upstream_refused_request"
        param = current.upstream_param if refused and current is not None else None

        async def finish() -> Output | None:
            await self._end("failed")
            return Failed.decided(action, param)

        return finish

    def _cancel_request(self, action: CancelRequest) -> Callable[[], Awaitable[Output | None]]:
        self.recorder.record(ev.RequestCancelled, reason=action.reason)

        async def finish() -> Output | None:
            await self._end("cancelled")
            return Cancelled(action.reason)

        return finish

    # --- what the loop gives -----------------------------------------------------------

    async def _observe_failure(self, run: AttemptRun, failure: UpstreamFailure) -> None:
        raise NotImplementedError

    async def _end(self, outcome: str) -> None:
        raise NotImplementedError

    def _tokens_now(self, run: AttemptRun, tokens: list[Token]) -> bool:
        raise NotImplementedError

    def _maybe_forget(self) -> None:
        raise NotImplementedError


async def _nothing() -> Output | None:
    return None
