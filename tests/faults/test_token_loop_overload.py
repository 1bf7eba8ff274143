"""An overloaded replica (heartbeats, a slow prefill) is not migrated on the soft first-token
deadline (tests/faults/token_loop.py)."""

from __future__ import annotations

from app.config import Timeouts
from statemachine import events as ev
from statemachine.events import FailureKind
from statemachine.request_state import Outcome
from tests.faults.conftest import Evidence, Fleet
from tests.faults.token_loop import body, prompt_for, replicas_of, settle
from tests.support.gateway import RunningGateway
from tests.support.transcript import of, stream_chat

# the case's slow prefill (1.5 s) passes the soft deadline, never the hard one
TIMEOUTS = Timeouts(
    stall_s=10.0,
    lease_ttl_s=10.0,
    cancel_ack_s=10.0,
    first_token_soft_s=0.3,
    first_token_hard_s=30.0,
    upstream_response_s=30.0,
)


# --- 6. an overloaded replica --------------------------------------------------------------------


def test_6_an_overloaded_replica_is_not_migrated_on_the_soft_timeout(
    loop_gateway: RunningGateway, live_fleet: Fleet, evidence: Evidence
) -> None:
    prompt = prompt_for("overloaded")
    live_fleet.fault_first_attempt(prompt, "slow_first", seconds=1.5)
    transcript = stream_chat(loop_gateway.url, body(prompt))
    events, state = settle(loop_gateway, transcript, evidence)
    assert state.outcome is Outcome.COMPLETED and replicas_of(events) == ["r1"]
    failures = of(events, ev.UpstreamFailed)
    if live_fleet.kind == "worker":  # heartbeats flowed: the soft timer fired and the policy waited
        assert [(f.kind, f.deadline) for f in failures] == [(FailureKind.OVERLOADED, ev.Deadline.SOFT)]  # type: ignore[attr-defined]
        assert [d.action for d in of(events, ev.Decided)] == ["start_attempt", "wait"]  # type: ignore[attr-defined]
    else:  # silent prefill on this kind: only the hard deadline could act, and it did not pass
        assert failures == []
