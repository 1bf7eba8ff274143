"""Property-based: any interleaving of upstream behaviour keeps the rule intact.

Hypothesis drives the pure model driver with every observation the gateway can make
(tokens, deliveries, tool calls, each failure kind with and without deadlines, cancel
acks, lease expiries, client disconnects) and checks, after every step, the
invariants the design promises.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from statemachine import events as ev
from statemachine.events import Deadline, FailureKind
from statemachine.phases import Phase
from statemachine.policy_config import PolicyConfig
from statemachine.replay import replay
from statemachine.request_state import DEAD_KINDS, FenceWait
from statemachine.state import fold
from tests.statemachine.model import ModelDriver


class RequestLifecycle(RuleBasedStateMachine):
    driver: ModelDriver

    @initialize(
        max_attempts=st.integers(min_value=1, max_value=4),
        replica_count=st.integers(min_value=0, max_value=4),
        global_budget=st.integers(min_value=0, max_value=3),
        cost_guard=st.sampled_from([None, 5, 50]),
        shape=st.sampled_from([{}, {"n": 2}, {"guided": True}, {"tools": True}]),
        kind=st.sampled_from(
            [
                {},  # workers: cancels acknowledged
                {"acknowledges_cancel": False, "aborts_on_close": True},  # OpenAI servers: closing aborts
            ]
        ),
    )
    def accept(
        self,
        max_attempts: int,
        replica_count: int,
        global_budget: int,
        cost_guard: int | None,
        shape: dict,
        kind: dict,
    ) -> None:
        config = PolicyConfig(max_attempts=max_attempts, retry_max_prompt_tokens=cost_guard)
        replicas = tuple(f"w{i}" for i in range(1, replica_count + 1))
        self.driver = ModelDriver(config=config, replicas=replicas, global_budget=global_budget, **shape, **kind)
        self.tool_calls = 0

    # --- what the environment can do ---------------------------------------------------

    def producing(self) -> bool:
        state = self.driver.state
        current = state.current_attempt
        return state.phase in (Phase.PREFILL, Phase.DECODE) and current is not None and current.live

    @precondition(lambda self: self.producing() and not self.driver.state.first_delta_sent)
    @rule()
    def first_token(self) -> None:
        self.driver.first_token()

    @precondition(producing)
    @rule(tokens=st.integers(min_value=1, max_value=4))
    def deliver(self, tokens: int) -> None:
        self.driver.deliver(tokens)

    @precondition(producing)
    @rule()
    def tool_call(self) -> None:
        self.driver.tool_call(index=self.tool_calls % 2, tool_call_id=f"call_{self.tool_calls % 2}")
        self.tool_calls += 1

    @precondition(producing)
    @rule()
    def complete(self) -> None:
        self.driver.complete()

    @precondition(producing)
    @rule(
        kind=st.sampled_from(list(FailureKind)),
        deadline=st.sampled_from([None, Deadline.SOFT, Deadline.HARD]),
    )
    def upstream_fails(self, kind: FailureKind, deadline: Deadline | None) -> None:
        self.driver.fail(kind, deadline=deadline if kind is FailureKind.OVERLOADED else None)

    @precondition(
        lambda self: (
            self.driver.state.phase is Phase.FENCED
            and self.driver.state.current_attempt is not None
            and self.driver.state.current_attempt.live
        )
    )
    @rule()
    def fenced_replica_dies(self) -> None:
        self.driver.fail(FailureKind.REPLICA_EXITED)

    def cancel_outstanding(self) -> bool:
        current = self.driver.state.current_attempt
        return current is not None and current.cancel_sent and not current.cancel_acked and current.released is None

    @precondition(cancel_outstanding)
    @rule()
    def cancel_acked(self) -> None:
        self.driver.ack()

    @precondition(
        lambda self: (
            (current := self.driver.state.current_attempt) is not None
            and current.released is None
            and not current.lease_expired
            and (current.fenced or current.cancel_sent)
        )
    )
    @rule()
    def lease_expires(self) -> None:
        self.driver.lease_expires()

    @precondition(
        lambda self: (
            (current := self.driver.state.current_attempt) is not None
            and current.released is None
            and current.waiting_for == FenceWait.CONNECTION_CLOSE
        )
    )
    @rule()
    def connection_closed(self) -> None:
        self.driver.connection_closed()

    @precondition(lambda self: self.driver.state.phase is not Phase.TERMINATED and not self.driver.state.client_gone)
    @rule()
    def client_disconnects(self) -> None:
        self.driver.client_gone()

    @rule()
    def nothing_new_happens(self) -> None:
        """Asking again without new observations decides nothing: no doubled actions."""
        assert self.driver.step() == []

    # --- what must hold after every step -----------------------------------------------

    @invariant()
    def the_fold_is_the_state(self) -> None:
        assert fold(self.driver.events) == self.driver.state

    @invariant()
    def no_retry_is_decided_after_the_first_delta(self) -> None:
        committed = False
        for event in self.driver.events:
            committed = committed or isinstance(event, ev.FirstDeltaCommitted)
            if committed:
                assert not (isinstance(event, ev.Decided) and event.action == "start_attempt")
                assert not isinstance(event, ev.AttemptStarted)

    @invariant()
    def never_two_attempts_live(self) -> None:
        ended: set[int] = set()
        for event in self.driver.events:
            if isinstance(event, ev.AttemptStarted):
                assert ended == set(range(1, event.attempt)), f"attempt {event.attempt} started beside a live one"
            elif isinstance(event, ev.AttemptReleased) or (
                isinstance(event, ev.UpstreamFailed) and event.kind in DEAD_KINDS
            ):
                ended.add(event.attempt)

    @invariant()
    def a_closed_connection_fences_only_before_any_delivery(self) -> None:
        committed = False
        for event in self.driver.events:
            committed = committed or isinstance(event, ev.FirstDeltaCommitted)
            if isinstance(event, ev.AttemptFenced) and event.waiting_for == FenceWait.CONNECTION_CLOSE:
                assert not committed
            if isinstance(event, ev.AttemptReleased) and event.because is ev.ReleaseReason.CONNECTION_CLOSED:
                assert not committed

    @invariant()
    def only_one_attempt_ever_delivers(self) -> None:
        publishers = {
            e.attempt for e in self.driver.events if isinstance(e, ev.DeltasDelivered | ev.FirstDeltaCommitted)
        }
        assert len(publishers) <= 1

    @invariant()
    def at_most_one_terminal_event(self) -> None:
        terminals = [
            e for e in self.driver.events if isinstance(e, ev.RequestCompleted | ev.RequestFailed | ev.RequestCancelled)
        ]
        assert len(terminals) <= 1
        if terminals:
            assert self.driver.state.phase is Phase.TERMINATED
            after = self.driver.events[self.driver.events.index(terminals[0]) + 1 :]
            assert all(
                isinstance(e, ev.CancelSent | ev.CancelAcked | ev.LeaseExpired | ev.AttemptReleased) for e in after
            )

    @invariant()
    def attempts_stay_within_the_budget(self) -> None:
        assert len(self.driver.state.attempts) <= self.driver.config.max_attempts

    @invariant()
    def failures_after_delivery_are_structured_errors(self) -> None:
        for event in self.driver.events:
            if isinstance(event, ev.RequestFailed) and event.partial_output:
                assert (event.code, event.retryable) == ("upstream_decode_interrupted", False)
                assert event.delivered_output_tokens == self.driver.state.delivered_output_tokens

    @invariant()
    def the_request_is_never_stuck(self) -> None:
        state = self.driver.state
        if state.phase in (Phase.PREFILL, Phase.DECODE):
            assert state.current_attempt is not None and state.current_attempt.live
        if state.phase is Phase.FENCED:
            current = state.current_attempt
            assert current is not None and current.fenced and current.cancel_sent

    @invariant()
    def replay_reports_no_divergence(self) -> None:
        result = replay(self.driver.events, self.driver.config)
        assert result.ok, result.divergence and result.divergence.describe()
        assert result.final_state == self.driver.state


RequestLifecycle.TestCase.settings = settings(
    max_examples=400,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRequestLifecycle = RequestLifecycle.TestCase
