"""Every row of the policy (docs/design.md §4, §5), driven through the pure model driver."""

from __future__ import annotations

import dataclasses

import pytest

from statemachine import events as ev
from statemachine.actions import Action, CancelAttempt, CancelRequest, FailRequest, FenceAttempt, StartAttempt, Wait
from statemachine.errors import IllegalTransition
from statemachine.events import Deadline, FailureKind
from statemachine.phases import Phase
from statemachine.policy import POLICY_VERSION, decide, decided_fields
from statemachine.policy_config import PolicyConfig
from statemachine.request_state import ActionName, FenceWait, Outcome
from tests.statemachine.model import ModelDriver


def started_attempts(driver: ModelDriver) -> list[ev.AttemptStarted]:
    return [e for e in driver.events if isinstance(e, ev.AttemptStarted)]


def test_a_new_request_starts_its_first_attempt() -> None:
    driver = ModelDriver()
    assert [type(e).__name__ for e in driver.events] == ["RequestAccepted", "Decided", "AttemptStarted"]
    decided = driver.events[1]
    assert isinstance(decided, ev.Decided)
    assert (decided.action, decided.reason, decided.policy_version) == (
        "start_attempt",
        "request_accepted",
        POLICY_VERSION,
    )
    assert decided.params == {
        "attempt": 1,
        "exclude_replicas": [],
        "migration": None,
        "replica": "w1",
        "model": "tiny",
        "placement": "least_outstanding",
        "pool": {"placements": 0, "replicas": [{"id": "w1"}, {"id": "w2"}, {"id": "w3"}]},
    }


def unplaced(actions: list[Action]) -> list[Action]:
    """The actions with where each start goes left out (tests/statemachine/test_routing.py checks that)."""
    return [
        dataclasses.replace(action, replica=None, model="", placement="", pool=None)
        if isinstance(action, StartAttempt)
        else action
        for action in actions
    ]


def test_nothing_to_decide_while_an_attempt_runs_well() -> None:
    driver = ModelDriver()
    driver.first_token()
    driver.deliver(3)
    assert decide(driver.state, driver.config) == []


@pytest.mark.parametrize("kind", [FailureKind.REPLICA_EXITED, FailureKind.REJECTED])
@pytest.mark.parametrize("after_first_token", [False, True])
def test_dead_source_before_first_delta_retries_on_another_replica(kind: FailureKind, after_first_token: bool) -> None:
    driver = ModelDriver()
    if after_first_token:  # computed upstream, never delivered: still retryable
        driver.first_token()
    actions = driver.fail(kind)
    migration = "new_request" if kind is FailureKind.REJECTED else "prefill_retry"
    assert unplaced(actions) == [StartAttempt(kind.value, 2, ("w1",), migration)]
    assert [a.replica_id for a in started_attempts(driver)] == ["w1", "w2"]
    driver.deliver(2)
    driver.complete()
    assert driver.state.outcome is Outcome.COMPLETED


def test_retry_never_goes_back_to_a_replica_already_tried() -> None:
    driver = ModelDriver(config=PolicyConfig(max_attempts=3))
    driver.fail(FailureKind.REPLICA_EXITED)
    actions = driver.fail(FailureKind.REPLICA_EXITED)
    assert unplaced(actions) == [StartAttempt("replica_exited", 3, ("w1", "w2"), "prefill_retry")]
    assert [a.replica_id for a in started_attempts(driver)] == ["w1", "w2", "w3"]


def test_the_per_request_budget_ends_the_request_retryable() -> None:
    driver = ModelDriver()
    driver.fail(FailureKind.REPLICA_EXITED)
    actions = driver.fail(FailureKind.REPLICA_EXITED)
    assert actions == [
        FailRequest(
            reason="retry_budget_exhausted",
            code="upstream_unavailable",
            message="all 2 attempts failed before any output was sent",
            partial_output=False,
            delivered_output_tokens=0,
            retryable=True,
            http_status=502,
        )
    ]
    assert len(started_attempts(driver)) == 2
    assert driver.state.outcome is Outcome.FAILED


@pytest.mark.parametrize("kind", list(FailureKind))
def test_after_the_first_delta_every_failure_terminates_without_retry(kind: FailureKind) -> None:
    driver = ModelDriver()
    driver.deliver(37)
    actions = driver.fail(kind, deadline=Deadline.HARD if kind is FailureKind.OVERLOADED else None)
    fail = actions[-1]
    assert isinstance(fail, FailRequest)
    assert (fail.code, fail.partial_output, fail.delivered_output_tokens, fail.retryable) == (
        "upstream_decode_interrupted",
        True,
        37,
        False,
    )
    assert fail.message == "generation stopped after part of the answer was sent"
    live_source = kind in (FailureKind.LIVENESS_UNCERTAIN, FailureKind.OVERLOADED)
    ends_now = FenceAttempt(
        f"{kind.value}_after_first_delta", 1, FenceWait.CANCEL_ACK_OR_LEASE_EXPIRY, request_waits=False
    )
    assert actions[:-1] == ([ends_now] if live_source else [])
    assert len(started_attempts(driver)) == 1
    assert driver.state.phase is Phase.TERMINATED


def test_decode_fence_completes_after_the_terminal_event() -> None:
    driver = ModelDriver()
    driver.deliver(2)
    driver.fail(FailureKind.LIVENESS_UNCERTAIN)
    names = [type(e).__name__ for e in driver.events[-6:]]
    assert names == ["UpstreamFailed", "Decided", "Decided", "AttemptFenced", "CancelSent", "RequestFailed"]
    driver.ack()  # bookkeeping after the terminal event stays legal
    attempt = driver.state.current_attempt
    assert attempt is not None and attempt.ended == "cancel_acked"
    assert driver.state.phase is Phase.TERMINATED and driver.state.outcome is Outcome.FAILED


@pytest.mark.parametrize("release", ["ack", "lease_expires"])
def test_uncertain_liveness_fences_first_then_retries_if_nothing_was_sent(release: str) -> None:
    driver = ModelDriver()
    driver.first_token()
    actions = driver.fail(FailureKind.LIVENESS_UNCERTAIN)
    assert actions == [FenceAttempt("liveness_uncertain", 1, FenceWait.CANCEL_ACK_OR_LEASE_EXPIRY, request_waits=True)]
    assert driver.state.phase is Phase.FENCED
    assert decide(driver.state, driver.config) == []  # waits: a cancel sent is not a cancel proven
    assert len(started_attempts(driver)) == 1
    getattr(driver, release)()
    assert len(started_attempts(driver)) == 2
    kinds = [type(e).__name__ for e in driver.events]
    assert kinds.index("AttemptReleased") < kinds.index("AttemptStarted", kinds.index("AttemptReleased"))


@pytest.mark.parametrize("delivered", [False, True])
def test_a_replica_without_cancel_acks_is_fenced_until_its_lease_expires(delivered: bool) -> None:
    driver = ModelDriver(acknowledges_cancel=False)
    if delivered:
        driver.deliver(2)
    actions = driver.fail(FailureKind.LIVENESS_UNCERTAIN)
    fence = actions[0]
    assert isinstance(fence, FenceAttempt)
    assert fence.wait_for is FenceWait.LEASE_EXPIRY
    assert fence.request_waits is not delivered  # after the first delta the stream ends at once
    fenced = [e for e in driver.events if isinstance(e, ev.AttemptFenced)]
    assert [e.waiting_for for e in fenced] == ["lease_expiry"]


def test_a_decision_the_policy_does_not_know_is_illegal() -> None:
    driver = ModelDriver()
    with pytest.raises(IllegalTransition, match="unknown action 'reboot'"):
        driver.record(ev.Decided, action="reboot", reason="why not", policy_version="x", params={})


def test_soft_timeout_on_an_overloaded_replica_waits_once() -> None:
    driver = ModelDriver()
    actions = driver.fail(FailureKind.OVERLOADED, deadline=Deadline.SOFT)
    assert actions == [Wait("overloaded_soft_timeout", 1)]
    assert decide(driver.state, driver.config) == []
    driver.first_token()
    driver.deliver(1)
    driver.complete()
    assert len(started_attempts(driver)) == 1 and driver.state.outcome is Outcome.COMPLETED


def test_soft_overload_after_first_delta_also_waits() -> None:
    driver = ModelDriver()
    driver.deliver(1)
    assert driver.fail(FailureKind.OVERLOADED, deadline=Deadline.SOFT) == [Wait("overloaded_soft_timeout", 1)]


def test_hard_deadline_on_an_overloaded_replica_fences_and_migrates() -> None:
    driver = ModelDriver()
    driver.fail(FailureKind.OVERLOADED, deadline=Deadline.SOFT)
    actions = driver.fail(FailureKind.OVERLOADED, deadline=Deadline.HARD)
    assert actions == [FenceAttempt("overloaded", 1, FenceWait.CANCEL_ACK_OR_LEASE_EXPIRY, request_waits=True)]
    driver.ack()
    assert [a.replica_id for a in started_attempts(driver)] == ["w1", "w2"]


@pytest.mark.parametrize("phase_setup", ["queued", "decoding", "fenced"])
def test_client_gone_cancels_upstream_and_starts_nothing(phase_setup: str) -> None:
    driver = ModelDriver()
    if phase_setup == "decoding":
        driver.deliver(4)
    if phase_setup == "fenced":
        driver.fail(FailureKind.LIVENESS_UNCERTAIN)
    actions = driver.client_gone()
    if phase_setup == "fenced":  # the fence already sent the cancel
        assert actions == [CancelRequest("client_gone")]
    else:
        assert actions == [CancelAttempt("client_gone", 1), CancelRequest("client_gone")]
    assert driver.state.outcome is Outcome.CANCELLED
    driver.ack()
    assert len(started_attempts(driver)) == 1


def test_client_gone_after_the_source_died_only_cancels_the_request() -> None:
    driver = ModelDriver(replicas=("w1",))
    driver.record(ev.UpstreamFailed, **driver.scoped(), kind=FailureKind.REPLICA_EXITED, detail="gone")
    assert driver.client_gone() == [CancelRequest("client_gone")]


def test_upstream_refusal_is_passed_on_and_not_retried() -> None:
    driver = ModelDriver()
    actions = driver.fail(FailureKind.REQUEST_REFUSED, upstream_status=400, upstream_code="context_length_exceeded")
    assert actions == [
        FailRequest(
            reason="upstream_refused_request",
            code="context_length_exceeded",
            message="request_refused observed",
            partial_output=False,
            delivered_output_tokens=0,
            retryable=False,
            http_status=400,
        )
    ]
    assert len(started_attempts(driver)) == 1


def test_upstream_refusal_without_details_gets_defaults() -> None:
    driver = ModelDriver()
    (fail,) = driver.fail(FailureKind.REQUEST_REFUSED)
    assert isinstance(fail, FailRequest)
    assert (fail.code, fail.http_status) == ("upstream_refused_request", 400)


def test_cost_guard_fails_fast_instead_of_a_long_reprefill() -> None:
    driver = ModelDriver(config=PolicyConfig(retry_max_prompt_tokens=1000), prompt_tokens=1001)
    (fail,) = driver.fail(FailureKind.REPLICA_EXITED)
    assert isinstance(fail, FailRequest)
    assert (fail.code, fail.retryable, fail.http_status) == ("retry_cost_exceeded", True, 503)
    at_limit = ModelDriver(config=PolicyConfig(retry_max_prompt_tokens=1000), prompt_tokens=1000)
    assert isinstance(at_limit.fail(FailureKind.REPLICA_EXITED)[0], StartAttempt)  # strictly greater trips it


def test_global_budget_denial_ends_the_request_retryable() -> None:
    driver = ModelDriver(global_budget=0)
    actions = driver.fail(FailureKind.REPLICA_EXITED)
    assert isinstance(actions[0], StartAttempt)
    assert isinstance(actions[1], FailRequest)
    assert (actions[1].code, actions[1].retryable, actions[1].http_status) == (
        "retry_budget_exhausted",
        True,
        503,
    )
    assert any(isinstance(e, ev.RetryBudgetDenied) for e in driver.events)
    assert len(started_attempts(driver)) == 1


def test_no_healthy_replica_left_fails_retryable() -> None:
    driver = ModelDriver(replicas=("w1",))
    actions = driver.fail(FailureKind.REJECTED)
    assert isinstance(actions[-1], FailRequest) and actions[-1].code == "no_replica_available"
    none_at_all = ModelDriver(replicas=())
    assert none_at_all.state.error_code == "no_replica_available"


@pytest.mark.parametrize("shape", [{"n": 3}, {"guided": True}, {"tools": True}])
def test_n_guided_and_tools_retry_normally_before_the_first_delta(shape: dict[str, object]) -> None:
    driver = ModelDriver(**shape)  # type: ignore[arg-type]
    if shape.get("tools"):
        driver.tool_call()
    assert isinstance(driver.fail(FailureKind.REPLICA_EXITED)[0], StartAttempt)
    if shape.get("tools"):
        driver.tool_call()  # the retry asks for the same tool call: same idempotency key
        keys = {call.idempotency_key for call in driver.state.tool_calls}
        assert keys == {"req_model:call_0"} and len(driver.state.tool_calls) == 2


def test_nothing_is_decided_while_a_decision_is_pending_or_after_the_end() -> None:
    driver = ModelDriver()
    driver.record(ev.UpstreamFailed, **driver.scoped(), kind=FailureKind.LIVENESS_UNCERTAIN, detail="stall")
    (fence,) = decide(driver.state, driver.config)
    driver.record(ev.Decided, **decided_fields(fence))
    assert driver.state.pending == frozenset({ActionName.FENCE_ATTEMPT})
    assert decide(driver.state, driver.config) == []


def test_terminated_requests_decide_nothing() -> None:
    driver = ModelDriver()
    driver.deliver(1)
    driver.complete()
    assert decide(driver.state, driver.config) == []


def test_a_lost_attempt_without_a_recorded_failure_is_retried() -> None:
    driver = ModelDriver()
    driver.record(ev.CancelSent, **driver.scoped())
    driver.record(ev.CancelAcked, **driver.scoped(), generated_tokens=0)
    driver.record(ev.AttemptReleased, **driver.scoped(), because=ev.ReleaseReason.CANCEL_ACKED)
    actions = decide(driver.state, driver.config, driver.pool)
    assert unplaced(actions) == [StartAttempt("cancel_acked", 2, ("w1",), "prefill_retry")]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"max_attempts": 0}, "at least 1"),
        ({"retry_max_prompt_tokens": -1}, "must not be negative"),
        ({"max_attempt": 3}, "unknown policy settings: max_attempt"),
        ({"max_attempts": "3"}, "must be an integer"),
        ({"max_attempts": True}, "must be an integer"),
    ],
)
def test_policy_config_is_validated(values: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PolicyConfig.from_mapping(values)


def test_policy_config_from_a_file_mapping() -> None:
    config = PolicyConfig.from_mapping({"max_attempts": 3, "retry_max_prompt_tokens": None})
    assert config == PolicyConfig(max_attempts=3)


# --- poison requests (docs/design.md §13) -------------------------------------------------------

SERVER_ERRORS = {
    "start refused with 500": {"kind": FailureKind.REJECTED, "upstream_status": 500, "upstream_code": "internal_error"},
    "engine failed on it": {"kind": FailureKind.REPLICA_EXITED, "upstream_code": "engine_error"},
}


def poisoned() -> FailRequest:
    return FailRequest(
        reason="poison_request",
        code="poison_request",
        message=(
            "the request failed with a server error on 2 attempts before any output; "
            "it is treated as poison and not retried"
        ),
        partial_output=False,
        delivered_output_tokens=0,
        retryable=False,
        http_status=502,
    )


@pytest.mark.parametrize("first", SERVER_ERRORS)
@pytest.mark.parametrize("second", SERVER_ERRORS)
def test_a_second_server_error_before_output_ends_the_request_as_poison(first: str, second: str) -> None:
    driver = ModelDriver(config=PolicyConfig(max_attempts=4))  # budget left: poison stops it anyway
    assert unplaced(driver.fail(**SERVER_ERRORS[first])) == [
        StartAttempt(SERVER_ERRORS[first]["kind"].value, 2, ("w1",), _migration(SERVER_ERRORS[first]["kind"]))
    ]
    assert driver.fail(**SERVER_ERRORS[second]) == [poisoned()]
    assert len(started_attempts(driver)) == 2
    assert driver.state.outcome is Outcome.FAILED and driver.state.error_code == "poison_request"


def _migration(kind: FailureKind) -> str:
    return "new_request" if kind is FailureKind.REJECTED else "prefill_retry"


def test_server_errors_need_not_be_consecutive_to_make_poison() -> None:
    driver = ModelDriver(config=PolicyConfig(max_attempts=4))
    driver.fail(**SERVER_ERRORS["engine failed on it"])
    driver.fail(FailureKind.REJECTED, upstream_status=503, upstream_code="replica_exiting")  # the replica's state
    assert driver.fail(**SERVER_ERRORS["start refused with 500"]) == [poisoned()]
    assert len(started_attempts(driver)) == 3


@pytest.mark.parametrize(
    "other",
    [
        {"kind": FailureKind.REJECTED, "upstream_status": 503, "upstream_code": "not_ready"},
        {"kind": FailureKind.REJECTED, "upstream_status": 502},
        {"kind": FailureKind.REPLICA_EXITED, "upstream_code": "lease_expired"},
        {"kind": FailureKind.REPLICA_EXITED},
    ],
)
def test_one_server_error_and_another_failure_is_not_poison(other: dict[str, object]) -> None:
    driver = ModelDriver()
    driver.fail(**SERVER_ERRORS["start refused with 500"])
    (fail,) = driver.fail(**other)  # type: ignore[arg-type]
    assert isinstance(fail, FailRequest)
    assert (fail.code, fail.retryable) == ("upstream_unavailable", True)


def test_one_server_error_then_an_answer_completes() -> None:
    driver = ModelDriver()
    driver.fail(**SERVER_ERRORS["engine failed on it"])
    driver.first_token()
    driver.deliver(2)
    driver.complete()
    assert driver.state.outcome is Outcome.COMPLETED


def test_a_server_error_after_the_first_delta_is_an_interruption_not_poison() -> None:
    driver = ModelDriver()
    driver.fail(**SERVER_ERRORS["engine failed on it"])
    driver.first_token()
    driver.deliver(2)
    (fail,) = driver.fail(**SERVER_ERRORS["engine failed on it"])
    assert isinstance(fail, FailRequest) and fail.code == "upstream_decode_interrupted"


def test_a_single_attempt_budget_reports_the_server_error_as_unavailable() -> None:
    driver = ModelDriver(config=PolicyConfig(max_attempts=1))
    (fail,) = driver.fail(**SERVER_ERRORS["start refused with 500"])
    assert isinstance(fail, FailRequest) and fail.code == "upstream_unavailable"
