"""Responses rebuilt from the log (docs/design.md §15): a stored response as ``GET
/v1/responses/{id}`` answers it, its input items, and the conversation before a
``previous_response_id``. The log is the response store: any instance answers, after any
restart, within the caller's tenant only.

A response's id is its request's (``resp_<hex>`` for ``req_<hex>``); its input is the
body the client sent, recorded durably before the response completed
(``RequestDriver.complete``), and its output the final attempt's deltas. Under
``content_policy`` ``digest`` or ``none`` there is no text to rebuild from, and a
conversation cannot be continued (400, saying why).
"""

from __future__ import annotations

from typing import Any

from app.api.errors import InvalidRequest, NotFound, failure_body
from app.api.request_ids import check_request_id
from app.api.responses.input import chat_messages
from app.api.responses.request import parse_responses_request
from app.api.responses.shape import ResponsesShape
from app.api.resume.log import LoggedDelta, deltas_of, failure_of, final_answer, produced_tail
from app.driver.context import GatewayContext
from app.driver.request import RESPONSES
from app.store.base import EventStore, RequestInput
from statemachine import events as ev
from statemachine.state import fold

MAX_TURNS = 256  # previous responses followed back at most, each one read
ENDED = ev.TERMINAL_EVENTS


def request_id_of(response_id: str, param: str = "response_id") -> str:
    """The request id a response id names (``resp_<hex>`` → ``req_<hex>``)."""
    if not response_id.startswith("resp_"):
        raise NotFound(f"no response '{response_id}'", param=param, code="response_not_found")
    request_id = "req_" + response_id.removeprefix("resp_")
    check_request_id(request_id)
    return request_id


async def response_events(store: EventStore, tenant: str, response_id: str, param: str) -> tuple[str, list[ev.Event]]:
    """The log of the tenant's response ``response_id`` (404 for another tenant's, or a
    request that is not a response)."""
    request_id = request_id_of(response_id, param)
    events = await store.read(request_id)
    accepted = events[0] if events else None
    if not isinstance(accepted, ev.RequestAccepted) or accepted.tenant != tenant or accepted.endpoint != RESPONSES:
        raise NotFound(f"no response '{response_id}'", param=param, code="response_not_found")
    if accepted.content_policy is not None:  # store: false
        raise NotFound(
            f"response '{response_id}' was not stored (store: false)", param=param, code="response_not_found"
        )
    return request_id, events


def response_from_log(request_id: str, events: list[ev.Event], shape: ResponsesShape) -> dict[str, Any]:
    """The response object as the log has it. A live one shows no output here: showing it
    is a delivery, which only its owner may record (app/api/responses/poll.py)."""
    terminal = next((e for e in events if isinstance(e, ENDED)), None)
    if terminal is None:
        return shape.response("in_progress")
    state = fold(events)
    if isinstance(terminal, ev.RequestCompleted):
        return shape.completion(*final_answer(events, state, terminal))
    delivered = [delta for event in events if isinstance(event, ev.DeltasDelivered) for delta in deltas_of(event)]
    for delta in [*delivered, *produced_tail(events, state)]:
        _delta_events(shape, delta)  # what a reader gets: the output before the failure
    return shape.failed_response(failure_body(request_id, failure_of(terminal, state, events))["error"])


def shown_deltas(events: list[ev.Event]) -> int:
    """How many deltas a reader of the ended response is shown: those delivered, then
    those produced with no client attached."""
    state = fold(events)
    return state.delivered_deltas + len(produced_tail(events, state))


def _delta_events(shape: ResponsesShape, delta: LoggedDelta) -> bytes:
    return shape.content_event(delta.index, delta.text, key=delta.key, logprobs=delta.logprobs)


def shape_of(
    ctx: GatewayContext, request_id: str, events: list[ev.Event], body: dict[str, Any] | None
) -> ResponsesShape:
    """The response's shape, from its recorded ``body`` (what it echoes); a log without
    the body (content_policy) echoes what a body of only its model would."""
    accepted = events[0]
    assert isinstance(accepted, ev.RequestAccepted)
    bare = {"model": accepted.model, "input": ""}
    try:
        generation = parse_responses_request(body or bare, ctx.config.limits)
    except InvalidRequest:  # a body an earlier release took
        generation = parse_responses_request(bare, ctx.config.limits)
    created = int(accepted.occurred_at.timestamp())
    return ResponsesShape(generation, request_id, created, fold(events).answered_by)


def kept_body(recorded: RequestInput | None) -> dict[str, Any] | None:
    """The client's body in a recorded input, where the log keeps it (content_policy)."""
    body = recorded.body if recorded is not None else None
    return body if isinstance(body, dict) and "input" in body else None


def body_of(recorded: RequestInput | None, response_id: str, param: str) -> dict[str, Any]:
    """The client's body in a recorded input; 400 where the log keeps none (content_policy)."""
    body = kept_body(recorded)
    if body is None:
        raise InvalidRequest(
            f"the log keeps no text of response '{response_id}' (content_policy), so it cannot be rebuilt",
            param=param,
            code="response_content_unavailable",
        )
    return body


async def earlier_turns(store: EventStore, tenant: str, response_id: str) -> list[dict[str, Any]]:
    """The chat messages of the conversation up to and including ``response_id``: each
    earlier response's input (its instructions do not carry over) and its output (the
    message and tool calls, with the ids the client saw; reasoning left out, as vLLM
    leaves it), oldest first."""
    param = "previous_response_id"
    turns: list[list[dict[str, Any]]] = []
    current: str | None = response_id
    while current is not None:
        if len(turns) >= MAX_TURNS:
            raise InvalidRequest(f"a conversation is followed back {MAX_TURNS} responses at most", param=param)
        request_id, events = await response_events(store, tenant, current, param)
        terminal = next((e for e in events if isinstance(e, ENDED)), None)
        if not isinstance(terminal, ev.RequestCompleted):
            status = "in_progress" if terminal is None else "failed"
            raise InvalidRequest(
                f"response '{current}' is {status}: a conversation continues from a completed response",
                param=param,
                code="previous_response_not_completed",
            )
        body = body_of(await store.read_input(request_id), current, param)
        answers, _, _, _ = final_answer(events, fold(events), terminal)
        turns.append([*chat_messages(None, body["input"]), *_output_messages(answers[0].texts, answers[0].tool_calls)])
        previous = body.get("previous_response_id")
        current = previous if isinstance(previous, str) else None
    return [message for turn in reversed(turns) for message in turn]


def _output_messages(texts: dict[str, list[str]], tool_calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    content = "".join(texts.get("content", ()))
    if not content and not tool_calls:
        return []
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if tool_calls:
        message["tool_calls"] = [
            {"id": call.get("id"), "type": "function", "function": call.get("function") or {}} for call in tool_calls
        ]
    return [message]
