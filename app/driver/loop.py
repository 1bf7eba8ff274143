"""The per-request loop: observe -> decide -> act -> append.

How this works: ``_drive`` is one async generator that runs the whole request, in a
task of its own (:mod:`app.driver.feed`). It asks ``decide()``, records each action as
``Decided``, carries the actions out, then reads the running attempt's next frame and
records what it observed; it yields what the client should receive next
(:class:`Delta`, :class:`Finished`, :class:`Failed`, :class:`Cancelled`;
:class:`Restarted` when a retry replaced an attempt whose output was never delivered).
The HTTP layer reads them as the attached client (``outputs``) and calls back through
:class:`app.driver.driver.RequestDriver`, this loop plus its edges.

While the loop waits for its attempt's next frame over the lean connections (an OpenAI
upstream's SSE, a worker's frames), the plain tokens of a read that arrives may be taken in
the connection's callback instead (``_tokens_now``: the same per-token step, without a
wake-up of the loop's task), when they are all there is to do.

Every action's events are recorded synchronously, before any await, so a cancellation
(the frame awaited abandoned by ``interrupt`` or ``poke``) never finds a decision half
carried out; the awaited parts (appends, opening a stream, waiting for a fence) come after.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable
from typing import Any

from app.driver.attempt import AttemptRun
from app.driver.charges import FailureCharges
from app.driver.context import GatewayContext
from app.driver.feed import AttachedClient, Feed
from app.driver.instance import GATEWAY_LOST, LOST_MESSAGE
from app.driver.interruptions import CANCELLED_BY_CLIENT, Interruption, LoopInterruptions
from app.driver.outcome_events import record_decided
from app.driver.outputs import Finished, Output, Restarted
from app.driver.recorder import Recorder
from app.driver.request import GenerationRequest
from app.driver.shielded import shielded
from app.driver.token_deltas import carries_delta, delta_of
from app.driver.tools import ToolCalls
from app.replicas.base import Done, Heartbeat, Token, ToolCallFrame, UpstreamFailure
from app.store.content import stricter
from statemachine import events as ev
from statemachine.actions import (
    Wait,
)
from statemachine.events import FailureKind
from statemachine.phases import Phase
from statemachine.policy import decide, needs_pool
from statemachine.policy_config import PolicyConfig
from statemachine.request_state import DEAD_KINDS, RequestState
from statemachine.routing import PoolSnapshot

log = logging.getLogger("phasegate.driver")


class RequestLoop(LoopInterruptions):
    """One request's loop, which carries out the policy's actions (:class:`LoopActions`);
    :class:`~app.driver.driver.RequestDriver` adds what the HTTP layer and the gateway call."""

    def __init__(self, ctx: GatewayContext, request_id: str, request: GenerationRequest, tenant: str) -> None:
        self.ctx = ctx
        self.request = request
        self.tenant = tenant
        self.timeouts = ctx.config.timeouts
        policy = ctx.config.content_policy if request.stored else stricter(ctx.config.content_policy, "digest")
        self.recorder = Recorder(ctx, RequestState(request_id=request_id), content_policy=policy)
        self.run: AttemptRun | None = None
        self.accepted_at = ctx.clock()
        self.created = 0  # the response's "created": when it was accepted, as the log tells it
        self._inter_token = ctx.metrics.inter_token.labels(model=request.model)  # looked up once, used per token
        self.last_delivery_at: float | None = None
        self.tool_calls = ToolCalls(ctx, self.recorder)
        self.charges = FailureCharges(ctx.pool, request_id)  # failures on their way to ejection counts
        self._restarted = False  # a retry opened: the consumer drops what it buffered
        self._interrupted: Interruption | None = None  # the gateway ends the request (drain, fenced)
        self.told: tuple[str, str] | None = None  # a final error the log could not take when told
        self._pulling: asyncio.Task[Any] | None = None  # the task waiting for the next frame
        self._poked = False  # an event recorded from outside the loop wants a decision now
        self._disconnects = 0  # clients that left: a grace timer acts only for the latest
        self._undecided: tuple[RequestState | None, PolicyConfig | None] = (None, None)  # decided nothing on these
        # the loop runs in the feed's task; a client that leaves only detaches (docs/design.md §12)
        self.feed = Feed(
            self._drive,
            ctx.spawn,
            on_unattended=self._unattended,
            on_unattended_error=self._unattended_error,
            name=f"loop {request_id}",
        )
        self.outputs: AttachedClient = self.feed.attach(0)  # the client that sent the request
        routing = ctx.config.routing.for_model(request.model)
        # the models an attempt of it may ask for: the pool's snapshot shows their replicas
        self._models = (
            request.model,
            *routing.fallbacks,
            *routing.context_window_fallbacks,
            *routing.content_policy_fallbacks,
        )

    @property
    def answered_by(self) -> str:
        """The model answering: the response's ``model`` (a fallback's, if one answers)."""
        return self.state.answered_by

    # --- the loop --------------------------------------------------------------------

    async def _drive(self) -> AsyncGenerator[Output, None]:
        reader = asyncio.current_task()  # the feed's task runs the whole generator
        while True:
            ended = None if self._decided_nothing_since() else await self._decide_and_act()
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
            if self.ctx.lease_lapsed():
                self.interrupt(GATEWAY_LOST, LOST_MESSAGE, record=False)
                continue
            if type(frame) is not Token:  # observed once the client has every delta (app/driver/feed.py)
                await self.feed.client_caught_up()
            if type(frame) is Token:
                if run.generated_tokens == 0:
                    self.recorder.record(ev.FirstTokenReceived, attempt=run.attempt, lease_epoch=run.lease_epoch)
                    self.charges.settle(poison=False)  # an attempt produced output: not poison
                run.generated_tokens += 1
                if carries_delta(frame):
                    run.deltas += 1
                    yield delta_of(frame, self.request.return_token_ids)
            elif type(frame) is Heartbeat:  # queued or in prefill: slow, not failed
                if frame.queue_position:
                    self.ctx.pool.queued_at(run.replica, frame.queue_position)
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
            elif type(frame) is ToolCallFrame:
                await self.tool_calls.emitted(run.attempt, run.lease_epoch, frame)
            elif type(frame) is Done:
                yield Finished(
                    tuple(frame.finish_reasons),
                    frame.usage,
                    self.tool_calls.by_choice,
                    tuple(frame.stop_reasons),
                    frame.usage_details,
                    frame.answer,
                )
                return

    def _tokens_now(self, run: AttemptRun, tokens: list[Token]) -> bool:
        """Tokens that arrived in one read while this loop waits for its attempt's next
        frame, taken in the upstream connection's callback when they are all there is to
        do: what ``_drive`` does for each (count it, hand its delta to the client) without
        a wake-up of the loop's task. Only when the loop awaits this attempt's next frame
        with nothing else pending (a poke, an interruption, a restart to tell), the first
        delta (and with it the commit point) is behind, the instance's lease holds, a
        client is attached, and the policy decides nothing on the state as it is;
        otherwise the task reads them as any frames. (The deltas the client is handed may
        close a delivery batch: the policy then looks at the state before the loop's next
        frame, as when the client's own task delivers them while the loop reads on.)"""
        if (
            self._pulling is None
            or self._poked
            or self._interrupted is not None
            or self._restarted
            or run is not self.run
            or run.deltas == 0
            or self.feed.client is None
            or self.ctx.lease_lapsed()
            or not self._nothing_to_decide()
        ):
            return False
        run.generated_tokens += len(tokens)
        with_ids = self.request.return_token_ids
        deltas = [delta_of(token, with_ids) for token in tokens if carries_delta(token)]
        if deltas:
            run.deltas += len(deltas)
            self.feed.offer(deltas)
        return True

    def _nothing_to_decide(self) -> bool:
        """The policy decides nothing on the state as it is, asked without a pool snapshot
        (a state that needs one: not known here, so ``False``)."""
        if self._decided_nothing_since():
            return True
        state, policy = self.state, self.ctx.config.policy
        if needs_pool(state) or decide(state, policy, None):
            return False
        self._undecided = (state, policy)
        return True

    def _decided_nothing_since(self) -> bool:
        """The policy decided nothing, with no pool snapshot, on the very state and policy
        there are now: ``decide()`` is pure, so it would decide nothing again (most tokens
        record nothing)."""
        return self.state is self._undecided[0] and self.ctx.config.policy is self._undecided[1]

    def _snapshot(self, state: RequestState) -> PoolSnapshot:
        """The pool as the policy places over it: the request's model at the revision its
        ``RequestAccepted`` recorded, a fallback at the one its first attempt was placed at,
        else (not tried yet) at the configured one (docs/design.md §16)."""
        config = self.ctx.config
        revisions = {model: state.revision_of(model) or config.model_revision(model) for model in self._models}
        return self.ctx.pool.snapshot(
            self._models, revisions=revisions, keep=state.replicas_tried, affinity_key=state.affinity_key
        )

    async def _decide_and_act(self) -> Output | None:
        """Decide and carry out until the policy has nothing to add."""
        while True:
            if self._decided_nothing_since():
                return None
            state, policy = self.state, self.ctx.config.policy
            pool = self._snapshot(state) if needs_pool(state) else None
            actions = decide(state, policy, pool)
            if not actions:
                if pool is None:
                    self._undecided = (state, policy)
                return None
            await self.feed.client_caught_up()  # decided on deliveries that are all recorded
            for action in actions:
                record_decided(self.recorder, action)
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
            retry_after_s=failure.retry_after_s,
        )
        self.charges.observe(run.replica, failure)
        if failure.kind in DEAD_KINDS:
            self.run = None
            await run.release()

    async def _end(self, outcome: str) -> None:
        """After the terminal event: make it durable, release, count, forget. Shielded:
        a client leaving at this moment must not leave the request half ended."""
        await shielded(self._ending(outcome))

    async def _ending(self, outcome: str) -> None:
        run, self.run = self.run, None
        try:
            await self.recorder.flush_shielded_already()
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
