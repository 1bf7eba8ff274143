"""A message's shape from the log (docs/design.md §17): its id, and the model whose answer the
log holds, as its ``RequestAccepted`` says; its stream is read again by the follower of the
log (app/api/resume/follow.py)."""

from __future__ import annotations

from app.api.messages.shape import MessagesShape
from app.driver.request import CHAT, GenerationRequest, MessagesCall
from statemachine import events as ev
from statemachine.state import fold


def shape_from_log(request_id: str, events: list[ev.Event]) -> MessagesShape:
    """A message's shape, from its ``RequestAccepted``: its id, and the model whose answer the log holds."""
    accepted = events[0]
    assert isinstance(accepted, ev.RequestAccepted)
    request = GenerationRequest(
        endpoint=CHAT, model=accepted.model, stream=True, include_usage=False, anthropic=MessagesCall(body={})
    )
    return MessagesShape(request, request_id, int(accepted.occurred_at.timestamp()), fold(events).answered_by)
