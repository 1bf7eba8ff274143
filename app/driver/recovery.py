"""Closing a request from what the log holds of it, when its own loop cannot.

A gateway instance that lapsed leaves requests open; the instance that sweeps it
(:mod:`app.driver.instance`) closes each: ``RequestFailed`` with the code
``gateway_lost`` (``partial_output`` and ``delivered_output_tokens`` from the log,
retryable only when nothing was delivered), then cancels the attempt that may still
run upstream and records how it ended (the ack, or the lease that has lapsed by
then because nobody renewed it). A request whose log was lost is closed the same
way once the log is back (:mod:`app.driver.log_loss`).

Both read the log first (:func:`close_from_log`), and the log may grow between that
read and the closing append: this store's own queue still holding appends of the
request (kept through an outage, written under the instance's new lease once it
registered again), or another instance closing it too. So the store's queue drains
before the read, and a closing append that collides (``StreamConflict``) reads the
log again and closes from there, or finds the request closed: it is never left open.
"""

from __future__ import annotations

import asyncio
import logging

from app.driver.context import GatewayContext
from app.driver.outcome_events import record_failed, record_stopped
from app.driver.recorder import Recorder
from app.replicas.base import UpstreamFailure
from app.store.errors import StreamConflict
from statemachine import events as ev
from statemachine.phases import Phase
from statemachine.policy import ended_by_gateway
from statemachine.request_state import RequestState
from statemachine.state import fold

log = logging.getLogger("phasegate.recovery")

GATEWAY_LOST = "gateway_lost"
GATEWAY_LOST_MESSAGE = "the gateway serving this request stopped before it ended"
STORE_FLUSH_WAIT_S = 5.0  # for the store's queue to drain before the log is read
CLOSE_TRIES = 5  # reads of the log, each followed by a closing append


async def close_from_log(
    ctx: GatewayContext, request_id: str, *, code: str = GATEWAY_LOST, message: str = GATEWAY_LOST_MESSAGE
) -> None:
    """Read the request from the log, once the store's own queue has drained, and end
    it there (:func:`close_in_log`); a closing append that collides with events that
    landed after the read reads again and retries (``CLOSE_TRIES`` reads in all).

    Raises ``TimeoutError`` when the queue does not drain within ``STORE_FLUSH_WAIT_S``,
    the store's errors otherwise, ``StreamConflict`` when every try collided.
    """
    for tries_left in reversed(range(CLOSE_TRIES)):
        await asyncio.wait_for(ctx.store.flush(), STORE_FLUSH_WAIT_S)
        state = fold(await ctx.store.read(request_id))
        try:
            await close_in_log(ctx, state, code=code, message=message)
            return
        except StreamConflict as exc:
            if not tries_left:
                raise
            log.warning("closing request %s collided with events written meanwhile (%s); reads again", request_id, exc)


async def close_in_log(
    ctx: GatewayContext,
    state: RequestState,
    *,
    code: str = GATEWAY_LOST,
    message: str = GATEWAY_LOST_MESSAGE,
) -> None:
    """End a request from what the log holds of it (``state``): ``RequestFailed`` with
    ``code``, then its live attempts cancelled and their ends recorded."""
    recorder = Recorder(ctx, state)
    live = [attempt for attempt in state.attempts if attempt.live]
    if state.phase is not Phase.TERMINATED:
        for attempt in live:
            if not attempt.cancel_sent:
                recorder.record(ev.CancelSent, attempt=attempt.attempt, lease_epoch=attempt.lease_epoch)
        record_failed(recorder, ended_by_gateway(state, code, message))
    lapsing = []
    for attempt in live:
        replica = ctx.pool.replicas.get(attempt.replica_id)
        generated = None
        if replica is not None and replica.client.acknowledges_cancel:
            try:
                generated = await replica.client.cancel(state.request_id, attempt.attempt, attempt.lease_epoch)
            except (UpstreamFailure, OSError) as exc:
                log.info("cancel of lost attempt %s/%d: %r", state.request_id, attempt.attempt, exc)
        if generated is not None:
            record_stopped(recorder, attempt.attempt, attempt.lease_epoch, generated)
        else:
            lapsing.append(attempt)
    await recorder.flush(durable=True)
    if lapsing:
        # Nobody has renewed these leases since the gateway died, so each lapses on its
        # replica within one TTL from now at the latest: record it then.
        await asyncio.sleep(ctx.config.timeouts.lease_ttl_s)
        for attempt in lapsing:
            record_stopped(recorder, attempt.attempt, attempt.lease_epoch, None)
        await recorder.flush(durable=False)
