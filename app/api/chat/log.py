"""A chat completion's or completion's answer from the log (docs/design.md §12): its shape, as
its ``RequestAccepted`` says, and its whole answer, for an idempotent POST again."""

from __future__ import annotations

from starlette.responses import JSONResponse

from app.api.chat.shape import ChatShape, completion_id
from app.api.errors import failure_body
from app.api.json_answer import JSONAnswer
from app.api.resume.log import failure_of, final_answer
from app.driver.request import GenerationRequest
from statemachine import events as ev
from statemachine.state import fold


def shape_from_log(request_id: str, events: list[ev.Event]) -> ChatShape:
    """How the request's answer is shaped (its endpoint, model, choices, log probabilities),
    from its ``RequestAccepted``; the model named is the one whose answer the log holds (a
    fallback's, if one answered)."""
    accepted = events[0]
    assert isinstance(accepted, ev.RequestAccepted)
    request = GenerationRequest(
        endpoint=accepted.endpoint,
        model=accepted.model,
        stream=True,
        max_tokens=0,
        n=accepted.n,
        logprobs=accepted.logprobs,
        return_token_ids=accepted.return_token_ids,
        include_usage=accepted.continuous_usage,  # (its usage chunk, with every chunk's)
        continuous_usage=accepted.continuous_usage,
    )
    created = int(accepted.occurred_at.timestamp())
    shape = ChatShape(request, completion_id(request, request_id), created, fold(events).answered_by)
    if shape.usage is not None:
        shape.usage.estimate = accepted.prompt_tokens  # the gateway's estimate, as the live stream's
    return shape


def whole_from_log(request_id: str, events: list[ev.Event], shape: ChatShape, headers: dict[str, str]) -> JSONResponse:
    """The whole answer of a request that ended, from its log: the final attempt's deltas,
    delivered or produced while no client was attached (docs/design.md §12), or its failure."""
    state = fold(events)
    terminal = next(e for e in events if isinstance(e, ev.TERMINAL_EVENTS))
    if not isinstance(terminal, ev.RequestCompleted):
        failed = failure_of(terminal, state, events)
        return JSONResponse(failure_body(request_id, failed), status_code=failed.http_status, headers=headers)
    return JSONAnswer(shape.completion(*final_answer(events, state, terminal)), headers=headers)
