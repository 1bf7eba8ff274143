"""docs/design.md §10, 1 and 2: a replica dies in prefill, or after token k was computed and
before its event was written: the client never sees the fragment (tests/faults/token_loop.py)."""

from __future__ import annotations

import pytest

from statemachine import events as ev
from statemachine.events import FailureKind
from statemachine.request_state import Outcome
from tests.faults.conftest import Evidence, Fleet
from tests.faults.token_loop import (
    INDICES,
    body,
    prompt_for,
    reference,
    replicas_of,
    settle,
    tokens_of,
)
from tests.support.gateway import RunningGateway
from tests.support.transcript import of, stream_chat

# --- 1. death during prefill -----------------------------------------------------------------


def test_1_death_in_prefill_gives_one_complete_answer(
    loop_gateway: RunningGateway, live_fleet: Fleet, evidence: Evidence
) -> None:
    prompt = prompt_for("prefill death")
    live_fleet.fault_first_attempt(prompt, "die", point="prefill")
    transcript = stream_chat(loop_gateway.url, body(prompt))
    events, state = settle(loop_gateway, transcript, evidence)
    assert state.outcome is Outcome.COMPLETED and transcript.done
    assert replicas_of(events) == ["r1", "r2"]
    assert transcript.text == reference(loop_gateway, live_fleet, prompt) != ""  # the second replica's own answer
    assert of(events, ev.UpstreamFailed)[0].kind is FailureKind.REPLICA_EXITED  # type: ignore[attr-defined]


# --- 2. death after token k was computed, before its event was written ----------------------------


@pytest.mark.parametrize("k", INDICES)
def test_2_death_before_token_k_is_written(
    loop_gateway: RunningGateway, live_fleet: Fleet, evidence: Evidence, k: int
) -> None:
    prompt = prompt_for(f"fragment {k}")
    live_fleet.fault_first_attempt(prompt, "die", k=k, point="before_frame")
    transcript = stream_chat(loop_gateway.url, body(prompt))
    events, state = settle(loop_gateway, transcript, evidence)
    answer = reference(loop_gateway, live_fleet, prompt)
    if k == 0:  # nothing reached the client: retried into one clean answer
        assert state.outcome is Outcome.COMPLETED and replicas_of(events) == ["r1", "r2"]
        assert transcript.text == answer
    else:  # k deltas were delivered: the stream ends, the fragment never shows
        assert state.outcome is Outcome.FAILED and replicas_of(events) == ["r1"]
        assert transcript.error is not None and transcript.error["code"] == "upstream_decode_interrupted"
        assert transcript.contents == list(tokens_of(answer, k)), "the client saw the fragment or lost a token"
