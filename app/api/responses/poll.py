"""A poll of a live response (``GET /v1/responses/{id}`` while it runs) on its owner,
which alone may record a delivery (docs/design.md §15).

Reading is receiving: a poll that shows output delivers it. The poller attaches to the
request as a resumer does (``ClientResumed``), the commit point is made durable if no
client received a delta before (``FirstDeltaCommitted``: from here a failure ends the
response ``failed``, never a retry), the new deltas are recorded as delivered, and the
poller leaves (``ClientDisconnected``); the answer is the response ``in_progress`` with
everything delivered so far. A poll that would show nothing new records nothing; one
that finds the request not waiting for a reader (its stream's client still attached,
its attempt between two tries) shows the output delivered so far. Under
``content_policy`` ``digest`` or ``none`` a poll with output is 409 ``resume_unavailable``,
as a stream read again is.
"""

from __future__ import annotations

from typing import Any

from app.api.errors import LogUnavailable
from app.api.responses.shape import ResponsesShape
from app.api.resume.log import ResumeUnavailable
from app.driver.context import GatewayContext
from app.driver.driver import RequestDriver
from app.store.errors import StoreError


async def poll_live(ctx: GatewayContext, request_id: str, shape: ResponsesShape) -> dict[str, Any] | None:
    """The live response as a poll shows it, on its owner; ``None`` where this instance
    does not run it (ended, or another instance's)."""
    driver = ctx.drivers.get(request_id)
    if not isinstance(driver, RequestDriver):
        return None
    deltas = driver.feed.deltas
    delivered = driver.recorder.delivered_deltas
    if deltas and driver.recorder.content_policy != "full":  # a delivery the log could not hold
        raise ResumeUnavailable(
            "the log keeps no text of this response (content_policy), so its output is shown once it ended"
            "; its outcome: still running"
        )
    if len(deltas) > delivered and (client := driver.attach(delivered - 1)) is not None:
        taken = client.ready_deltas(len(deltas))
        if taken and not driver.state.first_delta_sent:
            try:
                await driver.commit()  # durable before the poll answers with any output
            except StoreError:
                driver.log_lost(output_delivered=False)
                raise LogUnavailable() from None
        for delta in taken:
            driver.delivered(delta)
        driver.client_gone()  # the poller leaves; the response goes on
        delivered = driver.recorder.delivered_deltas
    for index, delta in enumerate(deltas[:delivered]):
        shape.content_event(index, delta.text, delta.choice, key=delta.key, logprobs=delta.logprobs)
    return shape.response("in_progress")
