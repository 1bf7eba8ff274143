"""The recovery pass: a gateway that was killed leaves requests open; close them.

On start, a gateway reads every non-terminal request that it owned (its id is on
``RequestAccepted``), and for each: records ``RequestFailed`` with the code
``gateway_lost`` (``partial_output`` and ``delivered_output_tokens`` from the log,
retryable only when nothing was delivered), then cancels the attempt that may still
run upstream and records how it ended (the ack, or the lease that has lapsed by
then because nobody renewed it).
"""

from __future__ import annotations

import asyncio
import logging

from app.driver.context import GatewayContext
from app.driver.recorder import Recorder
from app.replicas.base import UpstreamFailure
from statemachine import events as ev
from statemachine.phases import Phase
from statemachine.request_state import RequestState
from statemachine.state import fold

log = logging.getLogger("phasegate.recovery")

GATEWAY_LOST = "gateway_lost"


async def recover_lost_requests(ctx: GatewayContext) -> int:
    request_ids = await ctx.store.unfinished_requests(gateway=ctx.gateway_id)
    for request_id in request_ids:
        ctx.spawn(_close_logged(ctx, request_id), name=f"recover {request_id}")
    return len(request_ids)


async def _close_logged(ctx: GatewayContext, request_id: str) -> None:
    try:
        await close_in_log(ctx, fold(await ctx.store.read(request_id)))
    except Exception:  # one broken request must not keep the others open
        log.exception("could not close lost request %s", request_id)


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
        recorder.record(
            ev.RequestFailed,
            code=code,
            message=message,
            partial_output=state.first_delta_sent,
            delivered_output_tokens=state.delivered_output_tokens,
            retryable=not state.first_delta_sent,
        )
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
