"""Write the golden traces of tests/traces/ from the pure model driver.

    python -m tests.traces.generate

Run it only when the policy changes on purpose: the checked-in traces are the
record that replay compares against, and the divergent one must stay divergent.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from statemachine import events as ev
from statemachine.actions import FenceAttempt
from statemachine.events import Deadline, FailureKind
from statemachine.policy import decided_fields
from statemachine.request_state import FenceWait
from statemachine.trace import dump_trace
from tests.statemachine.model import ModelDriver

HERE = Path(__file__).resolve().parent


def clean_completion() -> ModelDriver:
    driver = ModelDriver("req_clean")
    driver.first_token()
    driver.deliver(3, "Hi ")
    driver.deliver(2, "there")
    driver.complete()
    return driver


def retry_before_first_delta() -> ModelDriver:
    driver = ModelDriver("req_retried")
    driver.first_token()  # computed upstream, never written downstream
    driver.fail(FailureKind.REPLICA_EXITED)
    driver.first_token()
    driver.deliver(4, "ok ")
    driver.complete()
    return driver


def decode_interrupted() -> ModelDriver:
    driver = ModelDriver("req_interrupted")
    driver.first_token()
    driver.deliver(5, "part ")
    driver.fail(FailureKind.REPLICA_EXITED)
    return driver


def fence_released_by_lease_expiry() -> ModelDriver:
    driver = ModelDriver("req_fenced")
    driver.fail(FailureKind.LIVENESS_UNCERTAIN)
    driver.lease_expires()
    driver.first_token()
    driver.deliver(2, "yo")
    driver.complete()
    return driver


def fence_released_by_connection_close() -> ModelDriver:
    """An OpenAI-compatible replica missed its first-token deadline: closing its connection
    is the fence, and the retry starts with no lease waited out (docs/design.md §7)."""
    driver = ModelDriver("req_closed", acknowledges_cancel=False, aborts_on_close=True)
    driver.fail(FailureKind.LIVENESS_UNCERTAIN)
    driver.connection_closed()
    driver.first_token()
    driver.deliver(2, "yo")
    driver.complete()
    return driver


def client_disconnect() -> ModelDriver:
    driver = ModelDriver("req_gone")
    driver.first_token()
    driver.deliver(3, "abc")
    driver.client_gone()
    driver.ack()  # the ack arrives after the terminal event: bookkeeping
    return driver


def client_resumed_within_grace() -> ModelDriver:
    driver = ModelDriver("req_resumed")
    driver.first_token()
    driver.deliver(3, "abc")
    driver.client_gone(resume_grace_s=10.0)  # generation goes on for the grace
    driver.produce(2, "de")  # produced with no client attached: not delivered
    driver.client_resumes(after=2)
    driver.deliver(3, "def")  # the two produced ones, then a new one
    driver.complete()
    return driver


def resume_grace_expired() -> ModelDriver:
    driver = ModelDriver("req_grace_expired")
    driver.first_token()
    driver.deliver(2, "ab")
    driver.client_gone(resume_grace_s=10.0)
    driver.produce(3, "cde")
    driver.grace_expires()  # nobody came back: cancelled
    driver.ack()
    return driver


def tool_call_replayed() -> ModelDriver:
    driver = ModelDriver("req_tool", tools=True)
    driver.tool_call(0, "call_wx1")
    driver.fail(FailureKind.REPLICA_EXITED)
    driver.tool_call(0, "call_wx1")  # the retry asks again: same key, the ledger runs it once
    driver.complete()
    return driver


def poison_request() -> ModelDriver:
    driver = ModelDriver("req_poison")
    driver.fail(FailureKind.REJECTED, upstream_status=500, upstream_code="internal_error")
    driver.fail(FailureKind.REPLICA_EXITED, upstream_code="engine_error")  # a second server error: poison
    return driver


def divergent_soft_timeout_migrated() -> ModelDriver:
    """Recorded by an older policy that fenced a replica on a *soft* timeout."""
    driver = ModelDriver("req_divergent")
    driver.record(
        ev.UpstreamFailed,
        **driver.scoped(),
        kind=FailureKind.OVERLOADED,
        detail="queued 2s",
        deadline=Deadline.SOFT,
    )
    old = FenceAttempt("overloaded", 1, FenceWait.CANCEL_ACK_OR_LEASE_EXPIRY, request_waits=True)
    params = {"attempt": 1, "wait_for": "cancel_ack_or_lease_expiry"}  # as that policy recorded a fence
    driver.record(ev.Decided, **{**decided_fields(old), "policy_version": "2026-10-01.0", "params": params})
    driver.act(old)
    driver.ack()
    driver.deliver(1, "z")
    driver.complete()
    return driver


SCENARIOS: dict[str, Callable[[], ModelDriver]] = {
    "clean_completion": clean_completion,
    "retry_before_first_delta": retry_before_first_delta,
    "decode_interrupted": decode_interrupted,
    "fence_released_by_lease_expiry": fence_released_by_lease_expiry,
    "fence_released_by_connection_close": fence_released_by_connection_close,
    "client_disconnect": client_disconnect,
    "client_resumed_within_grace": client_resumed_within_grace,
    "resume_grace_expired": resume_grace_expired,
    "tool_call_replayed": tool_call_replayed,
    "poison_request": poison_request,
    "divergent_soft_timeout_migrated": divergent_soft_timeout_migrated,
}

if __name__ == "__main__":
    for name, scenario in SCENARIOS.items():
        path = HERE / f"{name}.jsonl"
        path.write_text("".join(dump_trace(scenario().events, {"source": "tests/traces/generate.py"})))
        print(f"wrote {path.relative_to(HERE.parents[1])}")
