"""What the HTTP layer and the gateway call on a request in flight.

:class:`RequestDriver` is the request's loop (:mod:`app.driver.loop`, which decides
and acts) plus its two edges: the client's side, where the HTTP layer calls
``commit()`` before the first content byte, ``delivered()`` after each write,
``complete()`` before the last bytes and ``client_gone()`` when the client left;
and the gateway's side, which ends a request after the log was lost
(``log_lost``) or itself (the loop's ``interrupt``: a drain, an instance
that lost its lease).
"""

from __future__ import annotations

import contextlib
import logging

from app.driver import log_loss
from app.driver.loop import RequestLoop
from app.driver.outputs import Finished
from statemachine import events as ev
from statemachine.events import TokenLogprob
from statemachine.phases import Phase

log = logging.getLogger("phasegate.driver")


class RequestDriver(RequestLoop):
    # --- acceptance ------------------------------------------------------------------

    def accept(self, idempotency_key: str | None = None) -> None:
        """Record the request; its first pull appends it with the first attempt (group-committed)."""
        request = self.request
        accepted = self.recorder.record(
            ev.RequestAccepted,
            model=request.model,
            model_revision=self.ctx.config.model_revision(request.model) or "unknown",
            tenant=self.tenant,
            endpoint=request.endpoint,
            stream=request.stream,
            params_digest=request.params_digest(),
            prompt_tokens=request.estimated_prompt_tokens,
            n=request.n,
            guided=request.guided,
            tools=bool(request.tools),
            idempotency_key=idempotency_key,
            max_attempts=self.ctx.config.policy.max_attempts,
            seed=request.seed,
            gateway=self.ctx.gateway_id,
            trace_id=self.ctx.tracing.trace_id(),
            logprobs=request.logprobs,
        )
        assert accepted is not None
        self.created = int(accepted.occurred_at.timestamp())
        self.ctx.drivers[self.request_id] = self
        self.ctx.metrics.in_flight.inc()
        # the input, for replaying an incident; off the path to the first token
        self.ctx.spawn(
            self.ctx.store.record_input(
                self.request_id,
                request.raw,
                model_revision=self.ctx.config.model_revision(request.model),
                seed=request.seed,
            ),
            name=f"input {self.request_id}",
        )

    # --- the client's side: called by the HTTP layer ---------------------------------

    async def commit(self, *, flush: bool = True) -> None:
        """The commit point: durable before the first content byte is written. A whole
        answer (``flush=False``) makes it durable with its completion, in one append,
        since its first byte goes out after that: a failed append then leaves neither."""
        run = self.run
        assert run is not None, "commit needs the attempt whose output is delivered"
        self.recorder.record(ev.FirstDeltaCommitted, attempt=run.attempt, lease_epoch=run.lease_epoch)
        if flush:
            await self.recorder.flush(durable=True)
            self.recorder.appending_deliveries = True
        self.ctx.metrics.ttft.labels(model=self.request.model).observe(self.ctx.clock() - self.accepted_at)

    def delivered(
        self, text: str, tokens: int = 1, choice: int = 0, logprobs: tuple[TokenLogprob, ...] | None = None
    ) -> None:
        """A delta of ``choice`` was written to the client (no tokens: its tool calls),
        with its tokens' log probabilities when the request asked for them."""
        run = self.run
        assert run is not None
        now = self.ctx.clock()
        if self.last_delivery_at is not None:
            self._inter_token.observe(now - self.last_delivery_at)
        self.last_delivery_at = now
        self.recorder.delivered(run.attempt, run.lease_epoch, tokens, text, choice, logprobs)

    async def complete(self, finished: Finished) -> None:
        """Record the completion durably, before the final bytes go out."""
        self.recorder.record(
            ev.RequestCompleted,
            finish_reason=finished.finish_reasons[0] if finished.finish_reasons else "stop",
            usage=finished.usage,
            finish_reasons=finished.finish_reasons,
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
        self.ctx.spawn(self._close_after_log_loss(), name=f"log lost {self.request_id}")

    async def _close_after_log_loss(self) -> None:
        with contextlib.suppress(RuntimeError):  # still running: it ends on its own cancellation
            await self.outputs.aclose()
        run, self.run = self.run, None
        if run is not None:
            await run.release()  # unrenewed, its lease lapses on the replica; the close cancels it too
        await log_loss.close_when_back(self.ctx, self.recorder)
        self.count_end("failed")
        self.ctx.drivers.pop(self.request_id, None)

    def client_gone(self) -> None:
        """The client left: cancel upstream, start nothing new (in the background)."""
        if self.state.phase is not Phase.TERMINATED and not self.state.client_gone:
            self.ctx.spawn(self._after_client_gone(), name=f"client gone {self.request_id}")

    async def _after_client_gone(self) -> None:
        try:
            await self.outputs.aclose()  # the loop is abandoned where it stood
        except RuntimeError:  # pragma: no cover - still running: it ends on its own cancellation
            log.warning("request %s: the loop was still running when its client left", self.request_id)
        self.recorder.record(ev.ClientDisconnected)
        await self._decide_and_act()
