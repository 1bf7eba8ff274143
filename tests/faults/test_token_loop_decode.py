"""docs/design.md §10, 3: a replica dies right after delta k reached the client: the stream ends
with the final error, and no second generation starts (tests/faults/token_loop.py)."""

from __future__ import annotations

import pytest

from statemachine import events as ev
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

# --- 3. death right after delta k reached the client --------------------------------------------


@pytest.mark.parametrize("k", INDICES)
def test_3_death_after_delta_k_ends_the_stream(
    loop_gateway: RunningGateway, live_fleet: Fleet, evidence: Evidence, k: int
) -> None:
    prompt = prompt_for(f"after {k}")
    live_fleet.fault_first_attempt(prompt, "die", k=k, point="after_frame")
    transcript = stream_chat(loop_gateway.url, body(prompt))
    events, state = settle(loop_gateway, transcript, evidence)
    assert state.outcome is Outcome.FAILED and replicas_of(events) == ["r1"]  # no second generation
    assert not [d for d in of(events, ev.Decided) if d.action == "start_attempt" and d.params["attempt"] > 1]  # type: ignore[attr-defined]
    assert transcript.error is not None and transcript.done
    error = transcript.error
    assert (error["code"], error["partial_output"], error["retryable"]) == ("upstream_decode_interrupted", True, False)
    assert error["delivered_output_tokens"] == len(transcript.contents) == k + 1
    assert transcript.contents == list(tokens_of(reference(loop_gateway, live_fleet, prompt), k + 1))
