"""The per-request loop: observe -> decide -> act -> append.

How this works: ``_drive`` is one async generator that runs the whole request, in a
task of its own (:mod:`app.driver.feed`). It asks ``decide()``, records each action as
``Decided``, carries the actions out, then reads the running attempt's next frame and
records what it observed; it yields what the client should receive next
(:class:`Delta`, :class:`Finished`, :class:`Failed`, :class:`Cancelled`;
:class:`Restarted` when a retry replaced an attempt whose output was never delivered).
The HTTP layer reads them as the attached client (``outputs``) and calls back through
:class:`app.driver.driver.RequestDriver`, this loop plus its edges.

Every action's events are recorded synchronously, before any await, so a cancellation
(the frame awaited abandoned by ``interrupt`` or ``poke``) never finds a decision half
carried out; the awaited parts (appends, opening a stream, waiting for a fence) come after.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from datetime import timedelta
from typing import Any, NamedTuple

from app.driver.attempt import AttemptRun
from app.driver.charges import FailureCharges
from app.driver.context import GatewayContext
from app.driver.feed import AttachedClient, Feed
from app.driver.instance import GATEWAY_LOST, LOST_MESSAGE
from app.driver.outputs import Cancelled, Delta, Failed, Finished, Output, Restarted
from app.driver.recorder import Recorder
from app.driver.request import GenerationRequest
from app.driver.tools import ToolCalls
from app.replicas.base import Done, Heartbeat, Token, ToolCall, UpstreamFailure
from statemachine import events as ev
from statemachine.events import FailureKind
from statemachine.phases import Phase
from statemachine.policy import (
    POISON_REQUEST,
    Action,
    CancelAttempt,
    CancelRequest,
    FailRequest,
    FenceAttempt,
    StartAttempt,
    Wait,
    decide,
    ended_by_gateway,
)
from statemachine.request_state import DEAD_KINDS, RequestState

log = logging.getLogger("phasegate.driver")

LEASE_EXPIRY_MARGIN_S = 0.05  # clocks differ a little: wait past the replica's expiry
CANCELLED_BY_CLIENT = "cancelled_by_client"  # RequestCancelled's reason for a stop button


class RequestLoop:
    """One request's loop and the actions it carries out; :class:`~app.driver.driver.RequestDriver`
    adds what the HTTP layer and the gateway call."""

    def __init__(self, ctx: GatewayContext, request_id: str, request: GenerationRequest, tenant: str) -> None:
        self.ctx = ctx
        self.request = request
        self.tenant = tenant
        self.recorder = Recorder(ctx, RequestState(request_id=request_id))
        self.run: AttemptRun | None = None
        self.accepted_at = ctx.clock()
        self.created = 0  # the response's "created": when it was accepted, as the log tells it
        self._inter_token = ctx.metrics.inter_token.labels(model=request.model)  # looked up once, used per token
        self.last_delivery_at: float | None = None
        self.tool_calls = ToolCalls(ctx, self.recorder)
        self.charges = FailureCharges(ctx.pool, request_id)  # failures on their way to ejection counts
        self._restarted = False  # a retry opened: the consumer drops what it buffered
        self._interrupted: Interruption | None = None  # the gateway ends the request (drain, fenced)
        self._pulling: asyncio.Task[Any] | None = None  # the task waiting for the next frame
        self._poked = False  # an event recorded from outside the loop wants a decision now
        self._disconnects = 0  # clients that left: a grace timer acts only for the latest
        # the loop runs in the feed's task; a client that leaves only detaches (DESIGN.md §12)
        self.feed = Feed(
            self._drive,
            ctx.spawn,
            on_unattended=self._unattended,
            on_unattended_error=self._unattended_error,
            name=f"loop {request_id}",
        )
        self.outputs: AttachedClient = self.feed.attach(0)  # the client that sent the request

    @property
    def request_id(self) -> str:
        return self.recorder.request_id

    @property
    def state(self) -> RequestState:
        return self.recorder.state

    # --- the loop --------------------------------------------------------------------

    async def _drive(self) -> AsyncGenerator[Output, None]:
        reader = asyncio.current_task()  # the feed's task runs the whole generator
        while True:
            ended = await self._decide_and_act()
            if self._restarted:
                self._restarted = False
                yield Restarted()
            if ended is not None:
                yield ended
                return
            run = self.run
            if self._interrupted is not None:
                await self.feed.client_caught_up()
                yield await self._end_interrupted()
                return
            if run is None or self.state.phase is Phase.TERMINATED:
                return
            try:
                self._pulling = reader
                frame = await run.next_frame()
            except UpstreamFailure as failure:
                await self.feed.client_caught_up()
                await self._observe_failure(run, failure)
                continue
            except asyncio.CancelledError:
                poked, self._poked = self._poked, False
                if (self._interrupted is None and not poked) or reader is None or reader.uncancel() > 0:
                    raise
                continue
            finally:
                self._pulling = None
            if self.ctx.clock() >= self.ctx.lease_valid_until:
                # this instance's lease lapsed (a pause, a partition): nothing more goes out,
                # even before the lease's own timer runs (DESIGN.md §11)
                self.interrupt(GATEWAY_LOST, LOST_MESSAGE, record=False)
                continue
            if type(frame) is not Token:  # observed once the client has every delta (app/driver/feed.py)
                await self.feed.client_caught_up()
            if type(frame) is Token:
                if run.generated_tokens == 0:
                    self.recorder.record(ev.FirstTokenReceived, attempt=run.attempt, lease_epoch=run.lease_epoch)
                    self.charges.settle(poison=False)  # an attempt produced output: not poison
                run.generated_tokens += 1
                yield Delta(frame.text, frame.choice, len(frame.token_ids) or 1, frame.logprobs)
            elif type(frame) is Heartbeat:  # queued or in prefill: slow, not failed
                deadline = run.deadline_due()
                if deadline is not None:
                    waited = self.ctx.clock() - run.started_at
                    self.recorder.record(
                        ev.UpstreamFailed,
                        attempt=run.attempt,
                        lease_epoch=run.lease_epoch,
                        kind=FailureKind.OVERLOADED,
                        detail=f"queued for {waited:.1f}s",
                        deadline=deadline,
                    )
            elif type(frame) is ToolCall:
                await self.tool_calls.emitted(run.attempt, run.lease_epoch, frame)
            elif type(frame) is Done:
                yield Finished(tuple(frame.finish_reasons), frame.usage, self.tool_calls.by_choice)
                return

    async def _decide_and_act(self) -> Output | None:
        """Decide and carry out until the policy has nothing to add."""
        while True:
            actions = decide(self.state, self.ctx.config.policy)
            if not actions:
                return None
            await self.feed.client_caught_up()  # decided on deliveries that are all recorded
            for action in actions:
                self.recorder.record_decided(action)
            # record every action's events first, then await their side effects
            effects = [self._record_action(action) for action in actions]
            outcome: Output | None = None
            for effect in effects:
                result = await effect() if effect is not None else None
                outcome = outcome if result is None else result
            if outcome is not None:
                return outcome
            if all(isinstance(action, Wait) for action in actions):
                return None

    def _record_action(self, action: Action) -> Callable[[], Awaitable[Output | None]] | None:
        if isinstance(action, StartAttempt):
            return self._start_attempt(action)
        if isinstance(action, FenceAttempt):
            return self._fence(action)
        if isinstance(action, CancelAttempt):
            return self._cancel_attempt()
        if isinstance(action, FailRequest):
            return self._fail(action)
        if isinstance(action, CancelRequest):
            return self._cancel_request(action)
        return None  # Wait: nothing to do but keep reading

    # --- actions: each records its events now and returns what is left to await --------

    def _start_attempt(self, action: StartAttempt) -> Callable[[], Awaitable[Output | None]] | None:
        ctx, request = self.ctx, self.request
        if action.attempt > 1 and not ctx.budget.try_take():
            self.recorder.record(ev.RetryBudgetDenied, scope="global")
            ctx.metrics.retry_budget_denied.inc()
            return None
        replica = ctx.pool.choose(request.model, action.exclude_replicas)
        if replica is None:
            self.recorder.record(
                ev.NoReplicaAvailable,
                excluded=action.exclude_replicas,
                detail=f"no healthy replica serves {request.model}",
            )
            return None
        if action.migration is not None:
            ctx.metrics.migrations.labels(model=request.model, migration_type=action.migration).inc()
        ttl = ctx.config.timeouts.lease_ttl_s
        self.recorder.record(
            ev.AttemptStarted,
            attempt=action.attempt,
            lease_epoch=action.attempt,
            replica_id=replica.id,
            lease_expires_at=ctx.wall_clock() + timedelta(seconds=ttl),
            acknowledges_cancel=replica.client.acknowledges_cancel,
        )
        run = AttemptRun(
            replica,
            request.for_attempt(self.request_id, action.attempt, lease_ttl_s=ttl),
            clock=ctx.clock,
            timeouts=ctx.config.timeouts,
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
            return None

        return open_attempt

    def _fence(self, action: FenceAttempt) -> Callable[[], Awaitable[Output | None]]:
        run = self.run
        assert run is not None and run.attempt == action.attempt
        self.recorder.record(
            ev.AttemptFenced, attempt=run.attempt, lease_epoch=run.lease_epoch, waiting_for=action.wait_for
        )
        self.recorder.record(ev.CancelSent, attempt=run.attempt, lease_epoch=run.lease_epoch)
        self.run = None
        fence = self.ctx.spawn(self._settle(run, fenced=True), name=f"fence {self.request_id}/{run.attempt}")
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

    async def _settle(self, run: AttemptRun, *, fenced: bool) -> None:
        """Stop the attempt for good: cancel acknowledged, or its lease run out."""
        generated = await run.cancel()  # before the stream closes: the ack names the attempt
        await run.release()
        if generated is None:
            await asyncio.sleep(max(run.lease_expires_in, 0.0) + LEASE_EXPIRY_MARGIN_S)
        self.recorder.record_stopped(run.attempt, run.lease_epoch, generated)
        if fenced:
            released_by = "cancel_ack" if generated is not None else "lease_expiry"
            self.ctx.metrics.fences.labels(released_by=released_by).inc()
        await self.recorder.flush(durable=False)
        self._maybe_forget()

    def _fail(self, action: FailRequest) -> Callable[[], Awaitable[Output | None]]:
        self.recorder.record_failed(action)
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

    # --- observations ----------------------------------------------------------------

    async def _observe_failure(self, run: AttemptRun, failure: UpstreamFailure) -> None:
        self.recorder.record(
            ev.UpstreamFailed,
            attempt=run.attempt,
            lease_epoch=run.lease_epoch,
            kind=failure.kind,
            detail=failure.detail,
            upstream_status=failure.status,
            upstream_code=failure.code,
            upstream_param=failure.param,
        )
        self.charges.observe(run.replica, failure)
        if failure.kind in DEAD_KINDS:
            self.run = None
            await run.release()

    async def _end(self, outcome: str) -> None:
        """After the terminal event: make it durable, release, count, forget. Shielded:
        a client leaving at this moment must not leave the request half ended."""
        await asyncio.shield(self._ending(outcome))

    async def _ending(self, outcome: str) -> None:
        run, self.run = self.run, None
        try:
            await self.recorder.flush(durable=True)
        finally:
            if run is not None:
                await run.release()
        self.count_end(outcome)
        self._maybe_forget()

    def count_end(self, outcome: str) -> None:
        """The request ended (once): its outcome, its attempts, one fewer in flight."""
        self.charges.settle(poison=False)  # whatever else ended it, held failures count
        metrics = self.ctx.metrics
        metrics.requests.labels(model=self.request.model, outcome=outcome).inc()
        metrics.attempts.observe(len(self.state.attempts))
        metrics.in_flight.dec()

    def _maybe_forget(self) -> None:
        """Forget the request once it ended and no attempt of it may still publish."""
        if self.state.phase is Phase.TERMINATED and not any(a.live for a in self.state.attempts):
            self.ctx.drivers.pop(self.request_id, None)

    def cancel_now(self) -> None:
        """The client asked to stop (``POST /v1/requests/{id}/cancel``): end at once,
        recorded as ``RequestCancelled``, the attempt cancelled as bookkeeping."""
        self.interrupt(CANCELLED_BY_CLIENT, "the client cancelled the request", record=True)

    def poke(self) -> None:
        """Decide now: an event recorded from outside the loop (a client gone with no
        grace, the grace run out) may end the request; the frame awaited is abandoned."""
        if self._pulling is not None and not self._poked:
            self._poked = True
            self._pulling.cancel()

    def _unattended(self, output: Output) -> Awaitable[None] | None:
        """An output the loop produced while no client was attached (the driver's)."""
        raise NotImplementedError

    def _unattended_error(self, error: BaseException) -> None:
        """What the loop raised while no client was attached (the driver's)."""
        raise NotImplementedError

    def interrupt(self, code: str, message: str, *, record: bool) -> None:
        """End the request now with the final error ``code``: recorded as
        ``RequestFailed`` (a drain), or not (a fenced instance, whose log the sweeper
        closes with the same code). The frame being awaited is abandoned."""
        if self._interrupted is not None or self.state.phase is Phase.TERMINATED:
            return
        self._interrupted = Interruption(code, message, record)
        if self._pulling is not None:
            self._pulling.cancel()

    async def _end_interrupted(self) -> Output:
        assert self._interrupted is not None
        code, message, record = self._interrupted
        run, self.run = self.run, None
        if record:
            if run is not None:
                self.recorder.record(ev.CancelSent, attempt=run.attempt, lease_epoch=run.lease_epoch)
                self.ctx.spawn(self._settle(run, fenced=False), name=f"cancel {self.request_id}/{run.attempt}")
            self.recorder.close_batch()
            if code == CANCELLED_BY_CLIENT:
                end = self._cancel_request(CancelRequest(CANCELLED_BY_CLIENT))
            else:
                end = self._fail(ended_by_gateway(self.state, code, message))
            output = await end()
            assert output is not None
            return output
        delivered = self.recorder.delivered_output_tokens  # the log may lag: nothing more is written to it
        if run is not None:
            await run.release()  # its lease lapses unrenewed; the sweeper cancels it
        self.count_end("failed")
        self.ctx.drivers.pop(self.request_id, None)
        partial = delivered > 0 or self.state.first_delta_sent
        return Failed(code, message, partial, delivered, retryable=not partial, http_status=503)


class Interruption(NamedTuple):
    code: str
    message: str
    record: bool


async def _nothing() -> Output | None:
    return None
