"""Answers rebuilt from the log (DESIGN.md §12): a request's deltas as stream chunks, how
it ended, and its whole answer, for a resumed stream or an idempotent POST (app/api/resume.py).

``DeltasDelivered`` and ``DeltasProduced`` record each delta's choice, length and tokens
(a delta of no tokens is a choice's tool calls, their JSON), so the log alone gives every
delta back with its SSE id. Under ``content_policy`` ``digest`` or ``none`` there is no
text: :func:`check_resumable` refuses with 409 ``resume_unavailable``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from starlette.responses import JSONResponse

from app.api.errors import ApiError, failure_body
from app.api.sse import DONE, ResponseShape, response_id, sse_event
from app.driver.outputs import Failed
from app.driver.request import GenerationRequest
from statemachine import events as ev
from statemachine.events import TokenLogprob
from statemachine.request_state import RequestState
from statemachine.state import fold


class ResumeUnavailable(ApiError):
    status = 409
    type = "invalid_request_error"
    code = "resume_unavailable"


def check_resumable(events: list[ev.Event]) -> None:
    for event in events:
        if isinstance(event, ev.DeltasDelivered | ev.DeltasProduced) and (
            event.text is None or (not event.deltas and event.to_index - event.from_index > 1)
        ):
            outcome = fold(events).outcome
            error = ResumeUnavailable(
                "the log keeps no text of this request (content_policy), so its stream cannot be resumed"
                f"; its outcome: {outcome.value if outcome else 'still running'}"
            )
            raise error


def shape_from_log(request_id: str, events: list[ev.Event]) -> ResponseShape:
    """How the request's answer is shaped (its endpoint, model, choices, log probabilities),
    from its ``RequestAccepted``; the model named is the one whose answer the log holds (a
    fallback's, if one answered)."""
    accepted = events[0]
    assert isinstance(accepted, ev.RequestAccepted)
    request = GenerationRequest(
        endpoint=accepted.endpoint,
        model=accepted.model,
        stream=True,
        include_usage=False,
        max_tokens=0,
        n=accepted.n,
        logprobs=accepted.logprobs,
    )
    created = int(accepted.occurred_at.timestamp())
    return ResponseShape(request, response_id(request, request_id), created, fold(events).answered_by)


def deltas_of(
    event: ev.DeltasDelivered | ev.DeltasProduced,
) -> Iterator[tuple[int, int, str, int, tuple[TokenLogprob, ...] | None]]:
    """``(index, choice, text, tokens, logprobs)`` of each delta of the batch (log
    probabilities are kept with delivered text only)."""
    text = event.text or ""
    shapes = event.deltas or ((0, len(text), event.tokens),)  # a log before shapes: one delta a batch
    offset = 0
    for index, (choice, chars, tokens) in enumerate(shapes, start=event.from_index):
        kept = event.logprobs if isinstance(event, ev.DeltasDelivered) else None
        logprobs = kept[index - event.from_index] if kept is not None else None
        yield index, choice, text[offset : offset + chars], tokens, logprobs
        offset += chars


def delta_chunk(
    shape: ResponseShape,
    text: str,
    choice: int,
    tokens: int,
    logprobs: tuple[TokenLogprob, ...] | None,
    *,
    first: bool,
) -> str:
    if tokens == 0:  # a choice's tool calls, as their JSON
        return shape.tool_calls_chunk(json.loads(text), choice, first=first)
    if shape.request.logprobs is None:
        logprobs = None
    elif logprobs is None:
        logprobs = ()  # asked for, and not in the log (an older one): an empty list, as OpenAI's shape wants
    return shape.content_chunk(text, choice, first=first, logprobs=logprobs)


def ending(shape: ResponseShape, request_id: str, terminal: ev.Event, state: RequestState) -> Iterator[bytes]:
    """What followed the deltas: the finish, or the final error; then ``[DONE]``."""
    next_id = max(state.delivered_deltas, state.produced_deltas)
    if isinstance(terminal, ev.RequestCompleted):
        reasons = terminal.finish_reasons or (terminal.finish_reason,) * max(state.n, 1)
        for choice, reason in enumerate(reasons):
            yield sse_event(next_id + choice, shape.finish_chunk(reason, choice))
    else:
        failed = failure_of(terminal, state)
        yield sse_event(next_id, json.dumps(failure_body(request_id, failed)))
    yield DONE


def failure_of(terminal: ev.Event, state: RequestState) -> Failed:
    partial = state.first_delta_sent
    if isinstance(terminal, ev.RequestFailed):
        return Failed(
            terminal.code,
            terminal.message,
            terminal.partial_output,
            terminal.delivered_output_tokens,
            terminal.retryable,
            http_status=502,
        )
    assert isinstance(terminal, ev.RequestCancelled)
    message = f"the request was cancelled ({terminal.reason})"
    return Failed("request_cancelled", message, partial, state.delivered_output_tokens, False, http_status=499)


def whole_from_log(
    request_id: str, events: list[ev.Event], shape: ResponseShape, headers: dict[str, str]
) -> JSONResponse:
    """The whole answer of a request that ended, from its log: the final attempt's deltas,
    delivered or produced while no client was attached (DESIGN.md §12), or its failure."""
    state = fold(events)
    terminal = next(e for e in events if isinstance(e, ev.RequestCompleted | ev.RequestFailed | ev.RequestCancelled))
    if not isinstance(terminal, ev.RequestCompleted):
        failed = failure_of(terminal, state)
        return JSONResponse(failure_body(request_id, failed), status_code=failed.http_status, headers=headers)
    texts: dict[int, list[str]] = {}
    calls: dict[int, list[dict[str, object]]] = {}
    logprobs: dict[int, list[TokenLogprob]] = {}
    final = state.current_attempt.attempt if state.current_attempt is not None else 0
    answer: dict[int, tuple[int, str, int, tuple[TokenLogprob, ...] | None]] = {}  # delivered or produced (§12)
    for event in events:
        if isinstance(event, ev.DeltasDelivered | ev.DeltasProduced) and event.attempt == final:
            for index, choice, text, tokens, entries in deltas_of(event):
                if index not in answer or entries is not None:  # a delivered delta keeps its log probabilities
                    answer[index] = (choice, text, tokens, entries)
    for index in sorted(answer):
        choice, text, tokens, entries = answer[index]
        if tokens:
            texts.setdefault(choice, []).append(text)
            logprobs.setdefault(choice, []).extend(entries or ())
        else:
            calls[choice] = json.loads(text)
    reasons = list(terminal.finish_reasons or (terminal.finish_reason,) * max(state.n, 1))
    choices = range(len(reasons))
    completion = shape.completion(
        ["".join(texts.get(c, ())) for c in choices],
        reasons,
        terminal.usage,
        [calls.get(c, []) for c in choices],
        [logprobs.get(c, []) for c in choices] if shape.request.logprobs is not None else None,
    )
    return JSONResponse(completion, headers=headers)
