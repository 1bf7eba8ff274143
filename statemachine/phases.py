"""The phases of a request and the one table of their transitions (docs/design.md §2).

Everything that decides which event may follow which lives in ``TRANSITIONS``:
``phase × event type → next phase``. A pair missing from the table is illegal and
:func:`next_phase` raises :class:`IllegalTransition`. Invariants that need more than
the phase (which attempt may publish, whether a second attempt is already live) are
checked by :mod:`statemachine.state` when it applies the event.

``docs/phases.md`` is rendered from this table by ``ops/render_phases.py``; a test
fails when the picture and the table drift apart.
"""

from __future__ import annotations

import enum

from statemachine.errors import IllegalTransition
from statemachine.events import (
    AttemptFenced,
    AttemptReleased,
    AttemptStarted,
    CancelAcked,
    CancelSent,
    ClientDisconnected,
    ClientResumed,
    Decided,
    DeltasDelivered,
    DeltasProduced,
    Event,
    FirstDeltaCommitted,
    FirstTokenReceived,
    LeaseExpired,
    NoReplicaAvailable,
    RequestAccepted,
    RequestCancelled,
    RequestCompleted,
    RequestFailed,
    ResumeGraceExpired,
    RetryBudgetDenied,
    RetryWaitElapsed,
    StreamResumed,
    ToolCallEmitted,
    UpstreamFailed,
)


class Phase(enum.StrEnum):
    NEW = "new"  # no event yet: only RequestAccepted may come
    PREFILL = "prefill"  # an attempt is being prepared or runs; nothing delivered
    DECODE = "decode"  # the first delta was committed: no retry from here
    FENCED = "fenced"  # the attempt's liveness is uncertain; forward nothing, wait
    TERMINATED = "terminated"  # final: exactly one terminal event was recorded


NEW, PREFILL, DECODE, FENCED, TERMINATED = Phase

# The old attempt's fence may complete after the request ended (docs/design.md §2): these
# stay legal in TERMINATED as bookkeeping, so the log shows when it really stopped.
_FENCE_BOOKKEEPING: dict[type[Event], Phase] = {
    CancelSent: TERMINATED,
    CancelAcked: TERMINATED,
    LeaseExpired: TERMINATED,
    AttemptReleased: TERMINATED,
}

TRANSITIONS: dict[Phase, dict[type[Event], Phase]] = {
    NEW: {
        RequestAccepted: PREFILL,
    },
    PREFILL: {
        Decided: PREFILL,
        AttemptStarted: PREFILL,
        FirstTokenReceived: PREFILL,
        DeltasProduced: PREFILL,  # no client attached: produced, nothing delivered
        ToolCallEmitted: PREFILL,
        UpstreamFailed: PREFILL,
        RetryBudgetDenied: PREFILL,
        NoReplicaAvailable: PREFILL,
        CancelSent: PREFILL,
        CancelAcked: PREFILL,
        LeaseExpired: PREFILL,
        AttemptReleased: PREFILL,
        ClientDisconnected: PREFILL,
        ClientResumed: PREFILL,
        ResumeGraceExpired: PREFILL,
        RetryWaitElapsed: PREFILL,  # a timer: the wait before a retry on the same replica is over
        FirstDeltaCommitted: DECODE,
        AttemptFenced: FENCED,
        RequestCompleted: TERMINATED,
        RequestFailed: TERMINATED,
        RequestCancelled: TERMINATED,
    },
    DECODE: {
        Decided: DECODE,
        DeltasDelivered: DECODE,
        DeltasProduced: DECODE,
        ToolCallEmitted: DECODE,
        UpstreamFailed: DECODE,
        CancelSent: DECODE,
        CancelAcked: DECODE,
        LeaseExpired: DECODE,
        AttemptReleased: DECODE,
        ClientDisconnected: DECODE,
        ClientResumed: DECODE,
        ResumeGraceExpired: DECODE,
        AttemptFenced: FENCED,  # cleanup only: the request fails right after
        RequestCompleted: TERMINATED,
        RequestFailed: TERMINATED,
        RequestCancelled: TERMINATED,
    },
    FENCED: {
        Decided: FENCED,
        UpstreamFailed: FENCED,
        CancelSent: FENCED,
        CancelAcked: FENCED,
        LeaseExpired: FENCED,
        ClientDisconnected: FENCED,
        ClientResumed: FENCED,
        ResumeGraceExpired: FENCED,
        AttemptReleased: PREFILL,  # only when nothing was delivered (state.py checks)
        RequestFailed: TERMINATED,
        RequestCancelled: TERMINATED,
    },
    # an ended request's stream, resumed from the log, is bookkeeping too (docs/design.md §12)
    TERMINATED: {**_FENCE_BOOKKEEPING, StreamResumed: TERMINATED},
}


def next_phase(phase: Phase, event: Event) -> Phase:
    """The phase after ``event``, or :class:`IllegalTransition` if the table lacks it."""
    try:
        return TRANSITIONS[phase][type(event)]
    except KeyError:
        raise IllegalTransition(phase.value, type(event).__name__, event.request_id) from None
