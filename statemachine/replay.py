"""Replay: fold a recorded request and recompute every decision it logged.

The driver records each ``decide()`` call that returned actions as a run of
consecutive ``Decided`` events. Replay folds the events up to the first event of
each run, calls ``decide()`` on that state with the given config, and compares the
recomputed actions with the run (action, reason and parameters; the policy version
is reported, not compared). The first mismatch is the divergence; every run, with
what was recorded and what was recomputed, is kept in the result for a timeline that
marks each one. Like Temporal's replayer it returns a result and raises only when asked.

A placement (``start_attempt``, ``wait_to_retry``) is recomputed over the pool snapshot
its ``Decided`` event recorded: the same input, so the same replica, or a divergence.
A start recorded before placements were (no ``pool`` in its params) is compared
without them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from statemachine.actions import action_params
from statemachine.events import Decided, Event
from statemachine.policy import decide
from statemachine.policy_config import PolicyConfig
from statemachine.request_state import RequestState
from statemachine.routing import PoolSnapshot
from statemachine.state import apply


@dataclass(frozen=True, slots=True)
class Divergence:
    """Where recorded and recomputed decisions first differ."""

    seq: int  # the seq of the first Decided event of the differing run (or where one was due)
    recorded: tuple[dict[str, Any], ...]
    recomputed: tuple[dict[str, Any], ...]

    def describe(self) -> str:
        return f"at seq {self.seq}: recorded {summary(self.recorded)}, recomputed {summary(self.recomputed)}"


@dataclass(frozen=True, slots=True)
class DecisionRun:
    """One recorded ``decide()`` call: its ``Decided`` events and what the policy says now."""

    seq: int  # the seq of the run's first Decided event
    recorded: tuple[dict[str, Any], ...]
    recomputed: tuple[dict[str, Any], ...]

    @property
    def agrees(self) -> bool:
        return self.recorded == self.recomputed


@dataclass(frozen=True, slots=True)
class ReplayResult:
    request_id: str
    divergence: Divergence | None
    final_state: RequestState
    events: int
    decisions: int
    runs: tuple[DecisionRun, ...] = ()  # every decision run, in log order
    config: PolicyConfig = field(default_factory=PolicyConfig)  # what the decisions were recomputed with

    @property
    def ok(self) -> bool:
        return self.divergence is None

    def raise_on_divergence(self) -> None:
        if self.divergence is not None:
            raise ReplayDivergence(self)


class ReplayDivergence(Exception):
    def __init__(self, result: ReplayResult) -> None:
        assert result.divergence is not None
        self.result = result
        super().__init__(f"request {result.request_id} diverged {result.divergence.describe()}")


def decision_of(event: Decided) -> dict[str, Any]:
    return {"action": event.action, "reason": event.reason, "params": event.params}


def replay(events: Iterable[Event], config: PolicyConfig | None = None) -> ReplayResult:
    """Fold ``events`` (one request, in seq order) and check each recorded decision.

    Without ``config`` the request is replayed under the defaults with the retry
    budget its ``RequestAccepted`` recorded, so the log alone replays; a given
    ``config`` is the what-if question and is used as it is.

    Raises :class:`~statemachine.errors.IllegalTransition` if the trace itself breaks
    the state machine: that is a broken trace, not a divergent decision.
    """
    from_the_log = config is None
    config = config or PolicyConfig()
    state: RequestState | None = None
    runs: list[DecisionRun] = []
    recorded: list[dict[str, Any]] = []
    recomputed: list[dict[str, Any]] = []
    run_seq = 0
    count = decisions = 0
    for event in events:
        count += 1
        if state is None:
            state = RequestState(request_id=event.request_id)
        if isinstance(event, Decided):
            decisions += 1
            if not recorded:  # the first Decided of a run: recompute on the state before it
                run_seq = event.seq
                pool = event.params.get("pool")
                snapshot = PoolSnapshot.from_params(pool) if isinstance(pool, dict) else None
                recomputed = [_recomputed(action) for action in decide(state, config, snapshot)]
            recorded.append(decision_of(event))
            if _unplaced(event):
                recomputed = [_without_placement(decision) for decision in recomputed]
        elif recorded:
            runs.append(DecisionRun(run_seq, tuple(recorded), tuple(recomputed)))
            recorded = []
        state = apply(state, event)
        if from_the_log and state.max_attempts and state.max_attempts != config.max_attempts:
            config = replace(config, max_attempts=state.max_attempts)
    if state is None:
        raise ValueError("replay() needs at least one event")
    if recorded:
        runs.append(DecisionRun(run_seq, tuple(recorded), tuple(recomputed)))
    first = next((run for run in runs if not run.agrees), None)
    divergence = None if first is None else Divergence(first.seq, first.recorded, first.recomputed)
    return ReplayResult(state.request_id, divergence, state, count, decisions, tuple(runs), config)


_PLACEMENT_PARAMS = ("replica", "model", "placement", "pool")


def _unplaced(event: Decided) -> bool:
    """A start recorded before placements were (policy versions before 2026-12-01.3)."""
    return event.action == "start_attempt" and "pool" not in event.params


def _without_placement(decision: dict[str, Any]) -> dict[str, Any]:
    if decision["action"] != "start_attempt":
        return decision
    params = {name: value for name, value in decision["params"].items() if name not in _PLACEMENT_PARAMS}
    return {**decision, "params": params}


def _recomputed(action: Any) -> dict[str, Any]:
    return {"action": action.name, "reason": action.reason, "params": action_params(action)}


def summary(decisions: tuple[dict[str, Any], ...]) -> str:
    """Decisions as ``action(reason), …``; "no action" for none."""
    if not decisions:
        return "no action"
    return ", ".join(f"{d['action']}({d['reason']})" for d in decisions)
