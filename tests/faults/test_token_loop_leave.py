"""The client leaves at token k: the upstream is cancelled, nothing new starts
(tests/faults/token_loop.py)."""

from __future__ import annotations

import dataclasses

import pytest

from app.config import Timeouts
from statemachine.events import ReleaseReason
from statemachine.request_state import Outcome
from tests.faults.conftest import Evidence, Fleet
from tests.faults.token_loop import (
    INDICES,
    LONG,
    N,
    body,
    leave_once_accepted,
    prompt_for,
    replicas_of,
    settle,
)
from tests.support.gateway import RunningGateway
from tests.support.transcript import Transcript, released_by, stream_chat

# An openai replica's attempt is released when its lease lapses (it acknowledges no
# cancel): short here, but not so short that a loaded machine starves a worker's renewals
# before the client leaves (2 s did, in CI). A worker acknowledges the cancel, however long
# a loaded machine takes, so its lease is long: a machine that stopped the gateway for 8 s
# let a 4 s one lapse before the client left.
TIMEOUTS = Timeouts(
    stall_s=10.0,
    lease_ttl_s=4.0,
    cancel_ack_s=10.0,
    first_token_soft_s=10.0,
    first_token_hard_s=30.0,
    upstream_response_s=30.0,
)
TIMEOUTS_BY_KIND = {"worker": dataclasses.replace(TIMEOUTS, lease_ttl_s=30.0)}


@pytest.mark.parametrize("k", INDICES)
def test_7_a_client_leaving_at_token_k_cancels_upstream(
    slow_gateway: RunningGateway, slow_fleet: Fleet, evidence: Evidence, k: int
) -> None:
    prompt = prompt_for(f"leave {k}")
    if k == 0:  # gone before the first delta: the client gives up while headers are held back
        transcript = Transcript(leave_once_accepted(slow_gateway, body(prompt, max_tokens=N + 4)), 200)
    else:  # many more tokens than k: the answer cannot be over before the client leaves, however late it reads
        asked = body(prompt, max_tokens=LONG, ignore_eos=True)  # all of them (a sim's own length may be 16)
        transcript = stream_chat(slow_gateway.url, asked, on_delta=lambda n: n >= k)
    events, state = settle(slow_gateway, transcript, evidence, left=True)
    assert state.outcome is Outcome.CANCELLED and replicas_of(events) == ["r1"]  # nothing new started
    order = [type(e).__name__ for e in events]
    assert "ClientDisconnected" in order and "CancelSent" in order
    expected = ReleaseReason.CANCEL_ACKED if slow_fleet.kind == "worker" else ReleaseReason.LEASE_EXPIRED
    assert released_by(events, 1) is expected  # acknowledged where the replica can
    # the client read k deltas and left; the gateway may have written more before it saw that
    assert len(transcript.contents) == k <= state.delivered_output_tokens
