"""What the HTTP layer and the gateway call on a request in flight.

:class:`RequestDriver` is the request's loop (:mod:`app.driver.loop`, which decides
and acts) plus its two edges: the client's side, where the HTTP layer calls
``commit()`` before the first content byte, ``delivered()`` after each write,
``complete()`` before the last bytes, ``client_gone()`` when the client left and
``attach()`` when one comes back; and the gateway's side, which ends a request after
the log was lost (``log_lost``) or itself (the loop's ``interrupt``: a drain, an
instance that lost its lease).

A client that leaves detaches from the loop's feed (:mod:`app.driver.feed`), which
runs on: ``ClientDisconnected`` records the grace in force (``resume_grace_s``), and
until a client attaches again (``ClientResumed``) each delta is recorded as produced,
a finish completes the request, and a timer records ``ResumeGraceExpired``, on which
the policy cancels (docs/design.md §12). With no grace it cancels at once. A background
response (``run_in_background``, docs/design.md §15) runs so from its accept on, with no
grace to run out: its readers attach, leave and attach again as resumers do.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable

from app.driver import log_loss
from app.driver.feed import AttachedClient
from app.driver.loop import RequestLoop
from app.driver.outputs import Delta, Finished, Output
from app.driver.recorder import STORE_OUTAGE_GRACE_S
from app.store.errors import StoreError, StoreUnavailable
from statemachine import events as ev
from statemachine.deltas import TOOL_CALLS
from statemachine.phases import Phase
from statemachine.routing import Strategy

log = logging.getLogger("phasegate.driver")


class RequestDriver(RequestLoop):
    _input_recorded: asyncio.Task[None] | None = None  # the input's write (``accept``)

    # --- acceptance ------------------------------------------------------------------

    def accept(self, idempotency_key: str | None = None, *, background: bool = False) -> None:
        """Record the request; its first pull appends it with the first attempt (group-committed)."""
        request = self.request
        routing = self.ctx.config.routing.for_model(request.model)
        affinity = routing.strategy is Strategy.PREFIX_AFFINITY
        accepted = self.recorder.record(
            ev.RequestAccepted,
            model=request.model,
            model_revision=self.ctx.config.model_revision(request.model) or "unknown",
            tenant=self.tenant,
            endpoint=request.logged_endpoint,
            stream=request.stream,
            params_digest=request.params_digest(),
            prompt_tokens=request.estimated_prompt_tokens,
            n=request.choices,
            guided=request.guided,
            tools=bool(request.tools),
            idempotency_key=idempotency_key,
            max_attempts=self.ctx.config.policy.max_attempts,
            seed=request.seed,
            gateway=self.ctx.gateway_id,
            trace_id=self.ctx.tracing.trace_id(),
            logprobs=request.logprobs,
            return_token_ids=request.return_token_ids,
            continuous_usage=request.continuous_usage,
            routing=routing.to_params(compact=True),
            affinity_key=request.affinity_key() if affinity else None,
            metadata=request.metadata,
            background=background,
            content_policy=self.recorder.content_policy if not request.stored else None,
        )
        assert accepted is not None
        self.created = int(accepted.occurred_at.timestamp())
        self.ctx.drivers[self.request_id] = self
        self.ctx.metrics.in_flight.inc()
        # the input, for replaying an incident; off the path to the first token
        self._input_recorded = self.ctx.spawn(self._record_input(), name=f"input {self.request_id}")

    async def _record_input(self) -> None:
        """Write the request's input, retried through an outage as a durable append is
        (``STORE_OUTAGE_GRACE_S``): its events that the log took later must not be all
        that is left of it."""
        request = self.request
        deadline = self.ctx.clock() + STORE_OUTAGE_GRACE_S
        delay = 0.05
        while True:
            try:
                await self.ctx.store.record_input(
                    self.request_id,
                    request.client_body,
                    model_revision=self.ctx.config.model_revision(request.model),
                    seed=request.seed,
                    content_policy=self.recorder.content_policy,
                )
                return
            except StoreUnavailable:
                if self.ctx.clock() + delay > deadline:
                    raise
                log.warning("event log unavailable; request %s retries its input's write", self.request_id)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def _input_durable(self) -> None:
        """Until the input is written: a response's later turn and every read of it are
        built from it (docs/design.md §15). Written again once more where the first
        write gave up; :class:`StoreUnavailable` where that fails too, so that the
        response ends as the log lost it, never as a completion with no input."""
        written = self._input_recorded
        if written is None:
            return
        await asyncio.wait([written])
        if written.cancelled() or written.exception() is not None:  # logged where it ran
            self._input_recorded = self.ctx.spawn(self._record_input(), name=f"input {self.request_id} again")
            await asyncio.shield(self._input_recorded)

    def run_in_background(self) -> asyncio.Future[None]:
        """A background response, just accepted: no client is attached (a reader attaches
        later, as a resumer does) and it generates on; the future is its accept's durable
        append, which its POST waits for before answering."""
        assert self.state.background and self.state.client_gone, "accepted with background=True, whole"
        self.feed.detach()
        self.feed.start()
        return self.recorder.begin_durable_flush()

    # --- the client's side: called by the HTTP layer ---------------------------------

    async def commit(self, *, flush: bool = True) -> None:
        """The commit point: durable before the first content byte is written. A whole
        answer (``flush=False``) makes it durable with its completion, in one append,
        since its first byte goes out after that: a failed append then leaves neither."""
        if flush:
            await asyncio.shield(self.begin_commit())
            return
        self._record_commit_point()
        self._observe_ttft()

    def begin_commit(self) -> asyncio.Future[None]:
        """``commit()`` begun in this step (the commit point queued for its durable
        append), its end a future: the HTTP layer makes the response ready meanwhile and
        writes nothing of it before the future is done (awaited through ``asyncio.shield``)."""
        self._record_commit_point()
        durable = self.recorder.begin_durable_flush()
        if durable.done():  # a store that appends without a wait
            self._committed(durable)
        else:
            durable.add_done_callback(self._committed)  # before any waiter's: it runs first
        return durable

    def _record_commit_point(self) -> None:
        run = self.run
        assert run is not None, "commit needs the attempt whose output is delivered"
        self.recorder.record(ev.FirstDeltaCommitted, attempt=run.attempt, lease_epoch=run.lease_epoch)

    def _committed(self, durable: asyncio.Future[None]) -> None:
        if not durable.cancelled() and durable.exception() is None:
            self.recorder.appending_deliveries = True
            self._observe_ttft()

    def _observe_ttft(self) -> None:
        self.ctx.metrics.ttft.labels(model=self.request.model).observe(self.ctx.clock() - self.accepted_at)

    def delivered(self, delta: Delta, index: int | None = None) -> None:
        """``delta`` was written to the client (a choice's text under its key, or its tool
        calls' JSON, no tokens), with its tokens' log probabilities and ids when the
        request asked for them; one sent again to a resumed client (``index`` below the
        delivered count) was recorded before."""
        if index is not None and index < self.recorder.delivered_deltas:
            return
        run = self.run
        if run is None:  # a resumed client got a delta of an attempt that just failed: its end follows
            return
        now = self.ctx.clock()
        if self.last_delivery_at is not None:
            self._inter_token.observe(now - self.last_delivery_at)
        self.last_delivery_at = now
        self.recorder.delivered(run.attempt, run.lease_epoch, delta)

    async def complete(self, finished: Finished) -> None:
        """Record the completion durably, before the final bytes go out. A response's
        input is durable before it is (docs/design.md §15: a later turn is built from it)."""
        if self.request.responses is not None:
            await self._input_durable()
        self.recorder.record(
            ev.RequestCompleted,
            finish_reason=finished.finish_reasons[0] if finished.finish_reasons else "stop",
            usage=finished.usage,
            finish_reasons=finished.finish_reasons,
            usage_details=finished.usage_details,
            stop_reasons=finished.stop_reasons,
        )
        if self.run is not None:
            self.ctx.pool.succeeded(self.run.replica)
        await self._end("completed")

    def log_lost(self, *, output_delivered: bool) -> None:
        """The log stopped taking this request's events and its client was told so
        (:func:`app.driver.log_loss.failure`): from now on nothing more is recorded but
        what the client saw happen; the attempt stops and, once the log is back, the
        request is ended there (in the background)."""
        self.recorder.seal(output_delivered=output_delivered)
        self.told = (log_loss.EVENT_LOG_UNAVAILABLE, log_loss.MESSAGE)  # what the close records
        self.ctx.spawn(self._close_after_log_loss(), name=f"log lost {self.request_id}")

    async def _close_after_log_loss(self) -> None:
        await self.feed.stop()
        run, self.run = self.run, None
        if run is not None:
            await run.release()  # unrenewed, its lease lapses on the replica; the close cancels it too
        await log_loss.close_when_back(self.ctx, self.recorder)
        self.count_end("failed")
        self.ctx.drivers.pop(self.request_id, None)

    # --- a client that leaves, and one that comes back -------------------------------

    def client_gone(self) -> None:
        """The client left: generation goes on for ``resume_grace_s`` with no client
        attached, then the policy cancels upstream (at once with no grace)."""
        state = self.state
        if state.phase is Phase.TERMINATED or state.client_gone or self.recorder.sealed:
            return
        self.feed.detach()
        grace = self.ctx.config.resume_grace_s
        self.recorder.record(ev.ClientDisconnected, resume_grace_s=grace)
        self._disconnects += 1
        finished = self.feed.end if isinstance(self.feed.end, Finished) else None  # the loop decides no more
        if not self.state.awaits_a_client:  # no grace: the cancel is decided now
            if finished is not None:
                self.ctx.spawn(self._decide_and_act(), name=f"client gone {self.request_id}")
            else:
                self.poke()
                self.feed.start()  # a loop never pulled starts, to decide the cancel
            return
        for delta in self.feed.deltas[self.recorder.recorded_deltas :]:  # sent, never received
            self._produced(delta)
        if finished is not None:  # it left between the finish and its completion
            self.ctx.spawn(self._finish_unattended(finished), name=f"finish {self.request_id}")
        self.recorder.append_in_background()
        if not state.background:  # a background response waits for its readers with no end
            asyncio.get_running_loop().call_later(grace, self._grace_over, self._disconnects)
        self.feed.start()

    def serves_a_client(self) -> bool:
        """A client is attached to the live request (this instance saw none leave)."""
        state = self.state
        return state.phase is not Phase.TERMINATED and not state.client_gone and not self.recorder.sealed

    def attach(self, after: int) -> AttachedClient | None:
        """A client resumes the live request within its grace, having deltas up to
        ``after``: it gets the ones after, those produced meanwhile first. ``None`` when
        the request is not waiting for a client (one is attached, or it is ending)."""
        state = self.state
        if (
            state.phase is Phase.TERMINATED
            or not state.client_gone
            or not state.awaits_a_client
            or self._interrupted is not None
            or self.recorder.sealed
            or self.run is None  # between attempts: its resumer follows the log
        ):
            return None
        self.recorder.record(ev.ClientResumed, after=after, gateway=self.ctx.gateway_id)
        self.recorder.append_in_background()
        # a delta the log does not hold as delivered is sent again: never one skipped
        client = self.feed.attach(max(0, min(after + 1, self.recorder.delivered_deltas)))
        self.outputs = client
        self.feed.start()
        return client

    def _grace_over(self, disconnect: int) -> None:
        state = self.state
        if disconnect != self._disconnects or not state.client_gone or state.phase is Phase.TERMINATED:
            return  # a client came back (and may have left again since)
        if self.recorder.record(ev.ResumeGraceExpired) is not None:
            self.poke()

    def _unattended(self, output: Output) -> Awaitable[None] | None:
        if not self.state.awaits_a_client:  # nobody may come back: the cancel is being decided
            if isinstance(output, Finished):
                # the loop yielded its end and stopped, and the client left before the feed took
                # it (client_gone saw no end): the loop decides nothing more, so decide here
                self.ctx.spawn(self._decide_and_act(), name=f"client gone {self.request_id}")
            return None
        if type(output) is Delta:
            self._produced(output)
        elif isinstance(output, Finished):
            return self._finish_unattended(output)
        return None

    def _produced(self, delta: Delta) -> None:
        run = self.run
        if run is not None:
            self.recorder.produced(run.attempt, run.lease_epoch, delta)

    async def _finish_unattended(self, finished: Finished) -> None:
        """The answer finished with no client attached: its tool calls recorded as
        produced, and the completion; a client gets it all from the log."""
        run = self.run
        if run is not None:
            for delta in self.feed.deltas[self.recorder.recorded_deltas :]:
                self._produced(delta)
            calls_at = len(self.feed.deltas)  # each choice's tool calls follow the content deltas
            for offset, (choice, calls) in enumerate(sorted(finished.tool_calls.items())):
                if calls_at + offset >= self.recorder.recorded_deltas:
                    self.recorder.produced(
                        run.attempt, run.lease_epoch, Delta(json.dumps(calls), choice, 0, key=TOOL_CALLS)
                    )
        try:
            await self.complete(finished)
        except StoreError as exc:
            self._unattended_error(exc)

    def _unattended_error(self, error: BaseException) -> None:
        if isinstance(error, StoreError):
            log.error("request %s: the event log failed with no client attached", self.request_id)
            self.log_lost(output_delivered=self.state.first_delta_sent)
            return
        log.error("request %s: its loop failed with no client attached", self.request_id, exc_info=error)
