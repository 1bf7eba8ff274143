"""What the fold's handlers (:mod:`statemachine.handlers`) share: the illegal transition
they raise, an event's attempt looked up and checked against the request's attempts, and
the changes that put an attempt back into the state."""

from __future__ import annotations

from typing import Any

from statemachine.envelopes import AttemptScoped, RequestScoped
from statemachine.errors import IllegalTransition
from statemachine.evolve import evolve
from statemachine.request_state import AttemptState, RequestState

Changes = dict[str, Any]


def illegal(state: RequestState, event: RequestScoped, why: str) -> IllegalTransition:
    return IllegalTransition(state.phase.value, type(event).__name__, state.request_id, why)


def scoped(state: RequestState, event: AttemptScoped) -> AttemptState:
    attempt = state.attempt(event.attempt)
    if attempt is None:
        raise illegal(state, event, f"attempt {event.attempt} was never started")
    if attempt.lease_epoch != event.lease_epoch:
        raise illegal(
            state,
            event,
            f"lease epoch {event.lease_epoch} is not {attempt.lease_epoch} of attempt {event.attempt}",
        )
    return attempt


def live_current(state: RequestState, event: AttemptScoped) -> AttemptState:
    attempt = scoped(state, event)
    if attempt is not state.current_attempt or not attempt.live or attempt.fenced:
        raise illegal(state, event, f"attempt {event.attempt} is not the live attempt")
    return attempt


def unreleased(state: RequestState, event: AttemptScoped) -> AttemptState:
    attempt = scoped(state, event)
    if attempt.released is not None:
        raise illegal(state, event, f"attempt {event.attempt} was already released")
    return attempt


def with_current(state: RequestState, attempt: AttemptState) -> Changes:
    return {"attempts": (*state.attempts[:-1], attempt)}


def with_attempt(state: RequestState, attempt: AttemptState) -> Changes:
    index = attempt.attempt - 1
    return {"attempts": (*state.attempts[:index], attempt, *state.attempts[index + 1 :])}


def replaced_last(attempts: tuple[AttemptState, ...], **changes: object) -> tuple[AttemptState, ...]:
    return (*attempts[:-1], evolve(attempts[-1], changes))
