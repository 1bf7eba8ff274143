"""Answers rebuilt from the log (docs/design.md §12): a request's deltas as stream chunks, how
it ended, and its whole answer, for a resumed stream or an idempotent POST (app/api/resume/routes.py).

``DeltasDelivered`` and ``DeltasProduced`` record each delta's choice, length and tokens
(a delta of no tokens is a choice's tool calls, their JSON), so the log alone gives every
delta back with its SSE id. Under ``content_policy`` ``digest`` or ``none`` there is no
text: :func:`check_resumable` refuses with 409 ``resume_unavailable``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from app.api.errors import ApiError
from app.api.shape import ChoiceAnswer
from app.driver.outputs import Failed, full_usage
from app.driver.request import RESPONSES
from statemachine import events as ev
from statemachine.batches import delta_keys
from statemachine.deltas import CONTENT, Prompt, PromptLogprobs, TokenLogprob
from statemachine.request_state import RequestState
from statemachine.state import fold


class ResumeUnavailable(ApiError):
    status = 409
    type = "invalid_request_error"
    code = "resume_unavailable"


def check_resumable(events: list[ev.Event], *, responses: bool = False) -> None:
    """The log holds the text a stream is resumed from (409 ``resume_unavailable`` if not);
    a response's stream is read again as a response (``responses``), never as a chat's."""
    accepted = events[0]
    if isinstance(accepted, ev.RequestAccepted) and accepted.endpoint.startswith("/"):  # docs/design.md §17
        raise ResumeUnavailable(f"a pooling request ({accepted.endpoint}) has no stream, and its answer is not stored")
    if isinstance(accepted, ev.RequestAccepted) and (accepted.endpoint == RESPONSES) != responses:
        raise ResumeUnavailable(
            "not a response" if responses else "a response's stream is read with GET /v1/responses/{id}?stream=true"
        )
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


@dataclass(frozen=True, slots=True)
class LoggedDelta:
    """One delta as the log holds it (log probabilities are kept with delivered text only)."""

    index: int
    choice: int
    key: str  # the key of the client's delta its text went under (tool_calls: their JSON)
    text: str
    tokens: int
    logprobs: tuple[TokenLogprob, ...] | None
    token_ids: tuple[int, ...] = ()
    prompt: Prompt | None = None  # what the replica said of the choice's prompt, with its first delta
    prompt_tokens: int | None = None  # the prompt's tokens as the replica counted them, with the same (where asked)
    prompt_logprobs: PromptLogprobs | None = None  # the prompt's log probabilities, with the same (a whole answer's)


def deltas_of(event: ev.DeltasDelivered | ev.DeltasProduced) -> Iterator[LoggedDelta]:
    """Each delta of the batch."""
    text = event.text or ""
    shapes = event.deltas or ((0, len(text), event.tokens),)  # a log before shapes: one delta a batch
    keys = delta_keys(event) if event.deltas else (CONTENT,)
    kept, ids = event.logprobs, event.token_ids
    prompts = {choice: (token_ids, prompt_text) for choice, token_ids, prompt_text in event.prompts}
    counted = dict(event.prompt_tokens)
    prompt_logprobs = dict(event.prompt_logprobs)
    offset = 0
    for n, ((choice, chars, tokens), key) in enumerate(zip(shapes, keys, strict=True)):
        logprobs = kept[n] if kept is not None else None
        said = text[offset : offset + chars]
        yield LoggedDelta(
            event.from_index + n,
            choice,
            key,
            said,
            tokens,
            logprobs,
            ids[n] if ids else (),
            prompts.pop(choice, None),
            counted.pop(choice, None),
            prompt_logprobs.pop(choice, None),
        )
        offset += chars


def produced_tail(events: list[ev.Event], state: RequestState) -> list[LoggedDelta]:
    """The final attempt's deltas after its last delivered one, produced while no client
    was attached (a background response nobody read, a client that left): a reader of
    the ended response gets them (docs/design.md §12)."""
    current = state.current_attempt
    if current is None:
        return []
    produced = {
        delta.index: delta
        for event in events
        if isinstance(event, ev.DeltasProduced) and event.attempt == current.attempt
        for delta in deltas_of(event)
    }
    return [produced[index] for index in sorted(produced) if index >= state.delivered_deltas]


def failure_of(terminal: ev.Event, state: RequestState, events: list[ev.Event]) -> Failed:
    """The failure as its client was told it: the status the policy decided (its logged
    ``fail_request``; 502 for an ending no decision gave, a sweep's), and, for a request its
    replica refused, the ``param`` the replica named."""
    partial = state.first_delta_sent
    if isinstance(terminal, ev.RequestFailed):
        decided = [e for e in events if isinstance(e, ev.Decided) and e.action == "fail_request"]
        status = int(decided[-1].params.get("http_status", 502)) if decided else 502
        current = state.current_attempt
        refused = bool(decided) and decided[-1].reason == "upstream_refused_request" and current is not None
        return Failed(
            terminal.code,
            terminal.message,
            terminal.partial_output,
            terminal.delivered_output_tokens,
            terminal.retryable,
            http_status=status,
            param=current.upstream_param if refused and current is not None else None,
        )
    assert isinstance(terminal, ev.RequestCancelled)
    message = f"the request was cancelled ({terminal.reason})"
    return Failed("request_cancelled", message, partial, state.delivered_output_tokens, False, http_status=499)


def final_answer(
    events: list[ev.Event], state: RequestState, terminal: ev.RequestCompleted
) -> tuple[list[ChoiceAnswer], list[str], dict[str, Any], tuple[str | int | None, ...]]:
    """A completed request's answer, as a shape's ``completion`` takes it: each choice's
    deltas of the final attempt, delivered or produced while no client was attached
    (docs/design.md §12), how each finished, and the usage."""
    final = state.current_attempt.attempt if state.current_attempt is not None else 0
    answer: dict[int, LoggedDelta] = {}  # delivered or produced (docs/design.md §12)
    for event in events:
        if isinstance(event, ev.DeltasDelivered | ev.DeltasProduced) and event.attempt == final:
            for delta in deltas_of(event):
                if delta.index not in answer or delta.logprobs is not None:  # a delivered one keeps its logprobs
                    answer[delta.index] = delta
    reasons = list(terminal.finish_reasons or (terminal.finish_reason,) * max(state.n, 1))
    answers = [ChoiceAnswer() for _ in reasons]
    for index in sorted(answer):
        delta = answer[index]
        answers[delta.choice].add(
            delta.key, delta.text, delta.logprobs, delta.token_ids, delta.prompt, delta.prompt_logprobs
        )
    return answers, reasons, full_usage(terminal.usage, terminal.usage_details), terminal.stop_reasons
