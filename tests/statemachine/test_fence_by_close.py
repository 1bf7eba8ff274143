"""An OpenAI-compatible replica fenced by closing its connection (docs/design.md §7, amended).

Such a replica (``vllm serve``) aborts a request whose connection closed and gives no
acknowledgement. Before any delivery the gateway, the only publisher to the client,
counts the closed attempt as fenced: the policy waits for ``connection_close``, the
driver records ``AttemptReleased(connection_closed)`` once it closed the stream, and the
retry starts at once, with no lease to wait out. After a delivery nothing changes: the
fence waits for the lease, as bookkeeping. Pure: the model driver, no I/O.
"""

from __future__ import annotations

import pytest

from statemachine import events as ev
from statemachine.errors import IllegalTransition
from statemachine.events import FailureKind, ReleaseReason
from statemachine.jsonform import from_json, to_json
from statemachine.phases import Phase
from statemachine.policy import FenceAttempt, decide
from statemachine.replay import replay
from statemachine.request_state import FenceWait, Outcome
from statemachine.state import apply, fold
from tests.statemachine.model import ModelDriver


def openai_replicas(**kwargs: object) -> ModelDriver:
    """A request served by replicas that abort on a closed connection and ack no cancel."""
    return ModelDriver(acknowledges_cancel=False, aborts_on_close=True, **kwargs)  # type: ignore[arg-type]


def next_event(driver: ModelDriver, cls: type[ev.Event], **fields: object) -> ev.Event:
    seq = driver.state.seq + 1
    return cls(request_id=driver.request_id, seq=seq, occurred_at=driver.events[-1].occurred_at, **fields)  # type: ignore[arg-type]


def names(driver: ModelDriver) -> list[str]:
    return [type(e).__name__ for e in driver.events]


def test_before_any_delivery_the_fence_waits_only_for_the_connection_to_close() -> None:
    driver = openai_replicas()
    driver.first_token()  # produced upstream, never delivered: still before the commit point
    actions = driver.fail(FailureKind.LIVENESS_UNCERTAIN)
    assert actions == [FenceAttempt("liveness_uncertain", 1, FenceWait.CONNECTION_CLOSE, request_waits=True)]
    (fenced,) = [e for e in driver.events if isinstance(e, ev.AttemptFenced)]
    assert fenced.waiting_for == "connection_close"
    assert driver.state.phase is Phase.FENCED and decide(driver.state, driver.config) == []

    driver.connection_closed()

    tail = names(driver)[names(driver).index("AttemptFenced") :]
    assert tail == ["AttemptFenced", "CancelSent", "AttemptReleased", "Decided", "AttemptStarted"]
    assert "LeaseExpired" not in names(driver)  # no lease was waited out
    first, second = driver.state.attempts
    assert first.released is ReleaseReason.CONNECTION_CLOSED and first.ended == "connection_closed"
    assert second.replica_id == "w2" and second.live
    retry = [e for e in driver.events if isinstance(e, ev.Decided)][-1]
    assert (retry.action, retry.reason, retry.params["migration"]) == (
        "start_attempt",
        "liveness_uncertain",
        "prefill_retry",
    )
    driver.deliver(2)
    driver.complete()
    assert driver.state.outcome is Outcome.COMPLETED
    assert replay(driver.events).ok and fold(driver.events) == driver.state


@pytest.mark.parametrize(
    ("kind", "deadline"),
    [(FailureKind.LIVENESS_UNCERTAIN, None), (FailureKind.OVERLOADED, ev.Deadline.HARD)],
    ids=["first-token deadline or stall", "hard deadline"],
)
def test_every_fence_before_delivery_closes_the_connection(kind: FailureKind, deadline: ev.Deadline | None) -> None:
    driver = openai_replicas()
    (fence,) = driver.fail(kind, deadline=deadline)
    assert isinstance(fence, FenceAttempt) and fence.wait_for is FenceWait.CONNECTION_CLOSE


def test_after_the_first_delta_the_fence_waits_for_the_lease_as_before() -> None:
    driver = openai_replicas()
    driver.deliver(2)
    fence, fail = driver.fail(FailureKind.LIVENESS_UNCERTAIN)
    assert isinstance(fence, FenceAttempt)
    assert fence.wait_for is FenceWait.LEASE_EXPIRY and not fence.request_waits
    assert fail.code == "upstream_decode_interrupted"  # type: ignore[union-attr]
    closed = next_event(driver, ev.AttemptReleased, **driver.scoped(), because=ReleaseReason.CONNECTION_CLOSED)
    with pytest.raises(IllegalTransition, match="without a fence that waits for one"):
        apply(driver.state, closed)
    driver.lease_expires()  # bookkeeping after the terminal event
    assert driver.state.attempts[0].released is ReleaseReason.LEASE_EXPIRED and len(driver.state.attempts) == 1


def test_a_lease_expiry_still_releases_a_fence_that_waited_for_the_close() -> None:
    driver = openai_replicas()
    driver.fail(FailureKind.LIVENESS_UNCERTAIN)
    driver.lease_expires()  # e.g. recorded by the instance that swept a lost gateway
    assert [a.replica_id for a in driver.state.attempts] == ["w1", "w2"]


def test_the_fold_refuses_a_close_fence_the_replica_cannot_honour() -> None:
    worker = ModelDriver()  # a worker: closing its stream aborts nothing, its lease does
    wrong = next_event(worker, ev.AttemptFenced, **worker.scoped(), waiting_for="connection_close")
    with pytest.raises(IllegalTransition, match="only a replica that aborts on close"):
        apply(worker.state, wrong)

    delivered = openai_replicas()
    delivered.deliver(1)
    late = next_event(delivered, ev.AttemptFenced, **delivered.scoped(), waiting_for="connection_close")
    with pytest.raises(IllegalTransition, match="before any delivery"):
        apply(delivered.state, late)


def test_the_fold_refuses_a_close_release_without_a_close_fence() -> None:
    for driver in (ModelDriver(), ModelDriver(acknowledges_cancel=False)):
        driver.fail(FailureKind.LIVENESS_UNCERTAIN)  # fenced, waiting for an ack or the lease
        closed = next_event(driver, ev.AttemptReleased, **driver.scoped(), because=ReleaseReason.CONNECTION_CLOSED)
        with pytest.raises(IllegalTransition, match="without a fence that waits for one"):
            apply(driver.state, closed)


def test_workers_keep_their_fence() -> None:
    driver = ModelDriver()
    (fence,) = driver.fail(FailureKind.LIVENESS_UNCERTAIN)
    assert isinstance(fence, FenceAttempt) and fence.wait_for is FenceWait.CANCEL_ACK_OR_LEASE_EXPIRY


def test_an_attempt_started_before_the_field_existed_folds_as_not_aborting_on_close() -> None:
    driver = ModelDriver(acknowledges_cancel=False)
    started = next(e for e in driver.events if isinstance(e, ev.AttemptStarted))
    old = to_json(started)
    del old["body"]["aborts_on_close"]  # as logs written before recorded it
    assert from_json(old) == started and not started.aborts_on_close
    (fence,) = driver.fail(FailureKind.LIVENESS_UNCERTAIN)
    assert isinstance(fence, FenceAttempt) and fence.wait_for is FenceWait.LEASE_EXPIRY  # replays as recorded
