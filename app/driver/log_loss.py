"""A request whose events the log no longer takes: its answer stops, it is closed later.

The recorder retries a durable append for ``STORE_OUTAGE_GRACE_S`` (PostgreSQL away
longer than that), or PostgreSQL refuses the request's events outright; either way
nothing more of the request can be recorded, so the client must not be sent more of
its answer than the log will show. The HTTP layer ends the response with the final
error of DESIGN.md §6 (:func:`error_body`, code ``event_log_unavailable``) and
starts :func:`close_after_log_loss`. That stops the attempt and, once the log takes
appends again, writes what the request still had queued and ends it there:
``RequestFailed`` with the same code, the attempt cancelled
(:func:`app.driver.recovery.close_in_log`). Until then, or for good if the log stays
away longer than ``GIVE_UP_AFTER_S``, the request is open in the log, and the
gateway's next start closes it (``gateway_lost``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

from app.api.errors import policy_error_body
from app.driver.recovery import close_in_log
from app.store.errors import StoreError, StoreUnavailable
from statemachine.state import fold

if TYPE_CHECKING:
    from app.driver.driver import RequestDriver

log = logging.getLogger("phasegate.driver")

EVENT_LOG_UNAVAILABLE = "event_log_unavailable"
MESSAGE = "the request log became unavailable; the answer stops here"
NOTHING_SENT = "the request log is unavailable; try again shortly"
GIVE_UP_AFTER_S = 900.0
RETRY_EVERY_S = 1.0


def error_body(request_id: str, delivered_output_tokens: int) -> dict[str, Any]:
    """What the client is told: retryable only if it got nothing of the answer."""
    partial = delivered_output_tokens > 0
    return policy_error_body(
        request_id,
        code=EVENT_LOG_UNAVAILABLE,
        message=MESSAGE if partial else NOTHING_SENT,
        partial_output=partial,
        delivered_output_tokens=delivered_output_tokens,
        retryable=not partial,
        status=503,
    )


async def close_after_log_loss(driver: RequestDriver) -> None:
    """Stop the request's attempt; end the request in the log once the log is back."""
    ctx = driver.ctx
    with contextlib.suppress(RuntimeError):  # still running: it ends on its own cancellation
        await driver.outputs.aclose()
    run, driver.run = driver.run, None
    if run is not None:
        await run.release()  # unrenewed, its lease lapses on the replica; close_in_log cancels it too
    driver.recorder.withdraw_end()  # a completion the log did not take: the client was told it failed
    give_up_at = ctx.clock() + GIVE_UP_AFTER_S
    while True:
        try:
            await driver.recorder.flush(durable=True)  # what the request still had queued, first
            state = fold(await ctx.store.read(driver.request_id))
            await close_in_log(ctx, state, code=EVENT_LOG_UNAVAILABLE, message=MESSAGE)
            break
        except StoreUnavailable:
            if ctx.clock() >= give_up_at:
                log.error("request %s stays open in the log: it was away too long", driver.request_id)
                break
            await asyncio.sleep(RETRY_EVERY_S)
        except StoreError as exc:
            log.error("request %s stays open in the log (%s); the next start closes it", driver.request_id, exc)
            break
    driver.count_end("failed")
    ctx.drivers.pop(driver.request_id, None)
