"""The fold's fast copy-with-changes agrees with ``dataclasses.replace``."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

import pytest

from statemachine.evolve import evolve
from statemachine.phases import Phase
from statemachine.request_state import AttemptState, RequestState

T0 = datetime(2026, 11, 30, 12, tzinfo=UTC)


def test_evolve_is_replace() -> None:
    attempt = AttemptState(attempt=1, lease_epoch=3, replica_id="w1", started_at=T0, lease_expires_at=T0)
    state = RequestState("req_a", phase=Phase.PREFILL, seq=4, attempts=(attempt,), pending=frozenset({"x"}))
    for changes in ({}, {"seq": 5}, {"phase": Phase.DECODE, "first_delta_attempt": 1, "delivered_deltas": 2}):
        evolved = evolve(state, changes)
        assert evolved == dataclasses.replace(state, **changes)  # type: ignore[arg-type]
        assert type(evolved) is RequestState and evolved is not state
        assert evolved.__dict__ is not state.__dict__ and state.seq == 4  # a copy, the original intact
    assert evolve(attempt, {"fenced": True}) == dataclasses.replace(attempt, fenced=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        evolve(state, {}).seq = 9  # type: ignore[misc]


def test_evolve_refuses_an_unknown_field() -> None:
    with pytest.raises(TypeError, match="RequestState has no field phaze"):
        evolve(RequestState("req_a"), {"phaze": Phase.DECODE})


def test_evolve_refuses_a_slotted_class() -> None:
    @dataclasses.dataclass(frozen=True, slots=True)
    class Slotted:
        x: int = 0

    with pytest.raises(TypeError, match="Slotted is slotted"):
        evolve(Slotted(), {"x": 1})
