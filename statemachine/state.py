"""A request's state as a fold of its events: ``apply(state, event) -> state``.

How this works: :func:`apply` first asks the transition table for the next phase
(illegal pairs raise there), then checks the event against the request's invariants
and updates the fields the event speaks of (one handler per event type, in
:mod:`statemachine.handlers`). States and attempts are frozen; every
apply returns a new value, so a replayer can keep any intermediate state. Each
handler returns only the fields its event changes, and apply builds the one new state.

The invariants checked here are the ones the whole design rests on:

- events of one request arrive in ``seq`` order, 1, 2, 3…;
- a new attempt starts only when every earlier attempt is dead or released, with a
  larger lease epoch (never two attempts live at once);
- attempt-scoped events name an existing attempt and its own lease epoch;
- only the attempt that committed the first delta delivers, without gaps, and never
  after it was fenced (no splicing of two generations);
- a closed connection fences and releases only an attempt on a replica that aborts on
  it, and only before any delivery (docs/design.md §7); any other release names its proof;
- exactly one terminal event;
- time never goes back: each event's ``occurred_at`` is at or after the one before
  (:func:`advance` stamps a clock that stepped back, or another instance's that runs
  behind, with the last time recorded instead);
- counts are not negative, lease epochs neither, and a finish reason is one of
  :data:`~statemachine.events.FINISH_REASONS`.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any, TypeVar

from statemachine.attempts import illegal
from statemachine.events import Event
from statemachine.evolve import evolve as _evolve
from statemachine.handlers import HANDLERS
from statemachine.phases import next_phase
from statemachine.request_state import RequestState

E = TypeVar("E", bound=Event)


def apply(state: RequestState, event: Event) -> RequestState:
    """The state after ``event``; raises :class:`IllegalTransition` if it is not legal."""
    if event.request_id != state.request_id:
        raise illegal(state, event, f"event belongs to request {event.request_id}")
    if event.seq != state.seq + 1:
        raise illegal(state, event, f"seq {event.seq} does not follow {state.seq}")
    last = state.last_occurred_at
    if last is not None and event.occurred_at < last:
        raise illegal(state, event, f"time goes back: {event.occurred_at.isoformat()} is before {last.isoformat()}")
    phase = next_phase(state.phase, event)
    changes = HANDLERS[type(event)](state, event)
    changes["phase"] = phase
    changes["seq"] = event.seq
    changes["last_occurred_at"] = event.occurred_at
    return _evolve(state, changes)


def advance(state: RequestState, cls: type[E], occurred_at: datetime, **fields: Any) -> tuple[RequestState, E]:
    """The request's next event, stamped with the next ``seq`` and ``occurred_at``, and
    the state after it: the one way events are built (the driver's recorder, recovery,
    the pure model of the tests). Raises :class:`IllegalTransition` like :func:`apply`."""
    if state.last_occurred_at is not None and occurred_at < state.last_occurred_at:
        occurred_at = state.last_occurred_at  # a clock that stepped back: the log's times never go back
    event = cls(request_id=state.request_id, seq=state.seq + 1, occurred_at=occurred_at, **fields)
    return apply(state, event), event


def fold(events: Iterable[Event], state: RequestState | None = None) -> RequestState:
    """Apply ``events`` in order, from ``state`` or from the first event's request."""
    for event in events:
        if state is None:
            state = RequestState(request_id=event.request_id)
        state = apply(state, event)
    if state is None:
        raise ValueError("fold() needs at least one event or a starting state")
    return state
