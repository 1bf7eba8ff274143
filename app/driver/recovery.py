"""Closing a request from what the log holds of it, when its own loop cannot.

A gateway instance that lapsed leaves requests open; the instance that sweeps it
(:mod:`app.driver.instance`) closes each: ``RequestFailed`` with the code
``gateway_lost`` (``partial_output`` and ``delivered_output_tokens`` from the log,
retryable only when nothing was delivered), then cancels the attempt that may still
run upstream and records how it ended (the ack, or the lease that has lapsed by
then because nobody renewed it). A request whose log was lost is closed the same
way once the log is back (:mod:`app.driver.log_loss`).
"""

from __future__ import annotations

import asyncio
import logging

from app.driver.context import GatewayContext
from app.driver.recorder import Recorder
from app.replicas.base import UpstreamFailure
from statemachine import events as ev
from statemachine.phases import Phase
from statemachine.policy import ended_by_gateway
from statemachine.request_state import RequestState

log = logging.getLogger("phasegate.recovery")

GATEWAY_LOST = "gateway_lost"


async def close_in_log(
    ctx: GatewayContext,
    state: RequestState,
    *,
    code: str = GATEWAY_LOST,
    message: str = "the gateway serving this request stopped before it ended",
) -> None:
    """End a request from what the log holds of it (``state``): ``RequestFailed`` with
    ``code``, then its live attempts cancelled and their ends recorded."""
    recorder = Recorder(ctx, state)
    live = [attempt for attempt in state.attempts if attempt.live]
    if state.phase is not Phase.TERMINATED:
        for attempt in live:
            if not attempt.cancel_sent:
                recorder.record(ev.CancelSent, attempt=attempt.attempt, lease_epoch=attempt.lease_epoch)
        recorder.record_failed(ended_by_gateway(state, code, message))
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
            recorder.record_stopped(attempt.attempt, attempt.lease_epoch, generated)
        else:
            lapsing.append(attempt)
    await recorder.flush(durable=True)
    if lapsing:
        # Nobody has renewed these leases since the gateway died, so each lapses on its
        # replica within one TTL from now at the latest: record it then.
        await asyncio.sleep(ctx.config.timeouts.lease_ttl_s)
        for attempt in lapsing:
            recorder.record_stopped(attempt.attempt, attempt.lease_epoch, None)
        await recorder.flush(durable=False)
