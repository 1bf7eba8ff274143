"""A request whose events the log no longer takes: its answer stops, it is closed later.

The recorder retries a durable append for ``STORE_OUTAGE_GRACE_S`` (PostgreSQL away
longer than that), or PostgreSQL refuses the request's events outright; either way
nothing more of the request can be recorded, so the client must not be sent more of
its answer than the log will show. The HTTP layer ends the response with the final
error of docs/design.md §6 (:func:`failure`, code ``event_log_unavailable``) and starts
:meth:`~app.driver.driver.RequestDriver.log_lost`. That seals the request's recorder,
which keeps only what the client saw happen (not a completion the client was told
failed, not a commit point whose first delta never went out), and stops the attempt.
Once the log takes appends again (:func:`close_when_back`), what it kept is written
and the request ends there: ``RequestFailed`` with the same code, the attempt
cancelled (:func:`app.driver.recovery.close_in_log`), so the log says what the client
was told. Until then, or for good if the log stays away longer than
``GIVE_UP_AFTER_S``, the request is open in the log, and a live instance sweeps it
once this one's lease lapsed (``gateway_lost``).
"""

from __future__ import annotations

import asyncio
import logging

from app.driver.context import GatewayContext
from app.driver.outputs import Failed
from app.driver.recorder import Recorder
from app.driver.recovery import close_from_log
from app.store.errors import InstanceFenced, StoreError, StoreUnavailable

log = logging.getLogger("phasegate.driver")

EVENT_LOG_UNAVAILABLE = "event_log_unavailable"
MESSAGE = "the request log became unavailable; the answer stops here"
NOTHING_SENT = "the request log is unavailable; try again shortly"
GIVE_UP_AFTER_S = 900.0
RETRY_EVERY_S = 1.0


def failure(delivered_output_tokens: int) -> Failed:
    """What the client is told: retryable only if it got nothing of the answer."""
    partial = delivered_output_tokens > 0
    return Failed(
        code=EVENT_LOG_UNAVAILABLE,
        message=MESSAGE if partial else NOTHING_SENT,
        partial_output=partial,
        delivered_output_tokens=delivered_output_tokens,
        retryable=not partial,
        http_status=503,
    )


async def close_when_back(ctx: GatewayContext, recorder: Recorder) -> None:
    """Append what the request still had queued and end it in the log, retrying while
    the log is away (up to ``GIVE_UP_AFTER_S``)."""
    request_id = recorder.request_id
    give_up_at = ctx.clock() + GIVE_UP_AFTER_S
    while True:
        try:
            await recorder.flush(durable=True)  # what the request still had queued, first
            # then what the store still holds for it: appends kept through the outage (a
            # batch whose commit went unacknowledged, when the primary died, is written
            # again once the log is back). close_from_log waits for them before it reads
            # the log, and reads again if the closing append still collides (a sweeper
            # that took this instance over closing the request too).
            await close_from_log(ctx, request_id, code=EVENT_LOG_UNAVAILABLE, message=MESSAGE)
            return
        except (StoreUnavailable, InstanceFenced, TimeoutError):  # away; or away so long this instance lapsed
            if ctx.clock() >= give_up_at:
                log.error("request %s stays open in the log: it was away too long", request_id)
                return
            await asyncio.sleep(RETRY_EVERY_S)
        except StoreError as exc:
            log.error("request %s stays open in the log (%s); the next start closes it", request_id, exc)
            return
