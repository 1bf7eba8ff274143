"""What every recorded request must satisfy, whatever failed along the way.

``violations(events)`` checks one request's events, as read back from the log or a
trace, and names every broken rule; an empty list means the request kept them all.
The fault-injection tests and the chaos checker (``ops/chaos.py``) both judge by it.

    seq             1, 2, 3… without gap or repeat, one request id
    legal           the events fold without an illegal transition
    one terminal    exactly one of RequestCompleted, RequestFailed, RequestCancelled
    no overlap      an attempt starts only once every earlier attempt has stopped
    no splice       at most one attempt committed or delivered output
    decisions       replay recomputes every recorded decision
"""

from __future__ import annotations

from collections.abc import Sequence

from statemachine import events as ev
from statemachine.errors import IllegalTransition
from statemachine.events import Event
from statemachine.policy_config import PolicyConfig
from statemachine.replay import replay
from statemachine.request_state import DEAD_KINDS


def violations(events: Sequence[Event], config: PolicyConfig | None = None) -> list[str]:
    """Every rule ``events`` (one request, in seq order) breaks; empty when none."""
    if not events:
        return ["the request has no events"]
    found: list[str] = []
    if {event.request_id for event in events} != {events[0].request_id}:
        found.append("events of several requests are mixed")
    if [event.seq for event in events] != list(range(1, len(events) + 1)):
        found.append("seq has a gap or a repeat")
    terminals = sum(isinstance(event, ev.TERMINAL_EVENTS) for event in events)
    if terminals != 1:
        found.append(f"{terminals} terminal events")
    found.extend(_overlaps(events))
    publishers = {e.attempt for e in events if isinstance(e, ev.DeltasDelivered | ev.FirstDeltaCommitted)}
    if len(publishers) > 1:
        found.append(f"attempts {sorted(publishers)} all delivered output: a splice")
    if not found:  # replay needs a well-formed stream
        try:
            result = replay(events, config)
        except IllegalTransition as exc:
            found.append(f"illegal: {exc}")
        else:
            if result.divergence is not None:
                found.append(f"decision diverged {result.divergence.describe()}")
    return found


def _overlaps(events: Sequence[Event]) -> list[str]:
    stopped: set[int] = set()
    found = []
    for event in events:
        if isinstance(event, ev.AttemptStarted):
            if not stopped >= set(range(1, event.attempt)):
                found.append(f"attempt {event.attempt} started while an earlier one could still publish")
        elif isinstance(event, ev.AttemptReleased) or (
            isinstance(event, ev.UpstreamFailed) and event.kind in DEAD_KINDS
        ):
            stopped.add(event.attempt)
    return found
