"""The per-replica lease renewer's rounds, with a scripted replica (timing and bookkeeping only;
renewals over a real worker are in tests/app/driver/test_leases.py), and the gateway's view
of an attempt's lease that the rounds keep (``AttemptRun.lease_expires_in``)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from app.config import ReplicaConfig, Timeouts
from app.contract.worker_protocol import RENEWAL_SLACK
from app.driver.attempt import AttemptRun
from app.replicas.base import AttemptRequest, Renewal, UpstreamFailure
from app.replicas.renewer import LeaseRenewer
from app.replicas.replica import Replica
from statemachine.events import FailureKind
from tests.support.waiting import until

TTL = 0.3  # a round every 0.1 s


class ScriptedReplica:
    replica_id = "r1"

    def __init__(self, answers: list[Any]) -> None:
        self.answers = answers  # per round: a list of booleans, or an exception to raise
        self.rounds: list[list[str]] = []
        self.numbers: list[list[tuple[int, int]]] = []  # per round: each renewal's number and the last answered

    async def renew_all(self, renewals: Sequence[Renewal]) -> list[bool]:
        self.rounds.append([r.request_id for r, _, _ in renewals])
        self.numbers.append([(n, k) for _, n, k in renewals])
        answer = self.answers[min(len(self.rounds), len(self.answers)) - 1]
        if isinstance(answer, Exception):
            raise answer
        return list(answer)


def attempt_request(request_id: str) -> AttemptRequest:
    return AttemptRequest(request_id, 1, 1, TTL, "chat.completions", "m", None, "p", {})


class Held:
    def __init__(self, request_id: str) -> None:
        self.request = attempt_request(request_id)
        self.renewals = 0

    def next_renewal(self) -> tuple[int, int]:
        return self.renewals + 1, self.renewals

    def lease_renewed(self, renewal: int) -> None:
        self.renewals += 1


async def test_one_call_a_round_and_a_bad_answer_loses_only_its_round() -> None:
    replica = ScriptedReplica([KeyError("leases"), [True], [True, False]])
    renewer = LeaseRenewer(replica)  # type: ignore[arg-type]
    a, b = Held("a"), Held("b")
    renewer.hold(a)
    await until(lambda: a.renewals == 1)  # round 1 raised, round 2 renewed a
    renewer.hold(b)
    await until(lambda: a.renewals == 2)  # round 3 renewed a, refused b
    assert replica.rounds[:3] == [["a"], ["a"], ["a", "b"]]
    assert b.renewals == 0
    await renewer.drop(a)
    await renewer.drop(b)  # the last one out ends the rounds
    rounds = len(replica.rounds)
    await asyncio.sleep(0.25)
    assert len(replica.rounds) == rounds


async def test_rounds_start_again_after_the_last_attempt_left() -> None:
    replica = ScriptedReplica([[True]])
    renewer = LeaseRenewer(replica)  # type: ignore[arg-type]
    first = Held("a")
    renewer.hold(first)
    await renewer.drop(first)
    again = Held("b")
    renewer.hold(again)
    await until(lambda: again.renewals == 1)
    await renewer.drop(again)
    assert replica.rounds == [["b"]] and again.renewals == 1 and first.renewals == 0


async def test_renewals_are_numbered_each_naming_the_last_answered() -> None:
    """A round left unanswered (a cut) is named by none: the next renewal says the last whose
    answer came, so the worker extends the lease no further than the gateway counts on."""
    cut = UpstreamFailure(FailureKind.LIVENESS_UNCERTAIN, "the answer was lost")
    replica = ScriptedReplica([[True], cut, cut, [True], [True]])
    run = AttemptRun(
        Replica(ReplicaConfig(id="r1", url="http://r1"), replica),  # type: ignore[arg-type]
        attempt_request("a"),
        clock=asyncio.get_running_loop().time,
        timeouts=Timeouts(),
    )
    run.replica.renewer.hold(run)
    await until(lambda: len(replica.numbers) >= 5)
    await run.replica.renewer.drop(run)
    assert [round_[0] for round_ in replica.numbers[:5]] == [(1, 0), (2, 1), (3, 1), (4, 1), (5, 4)]


def test_the_gateways_view_of_a_lease_runs_longer_while_a_renewal_is_unanswered() -> None:
    now = [100.0]
    replica = Replica(ReplicaConfig(id="r1", url="http://r1"), ScriptedReplica([]))  # type: ignore[arg-type]
    run = AttemptRun(replica, attempt_request("a"), clock=lambda: now[0], timeouts=Timeouts())
    assert run.lease_expires_in == pytest.approx(TTL)  # from the start's answer (here: made now)
    assert run.next_renewal() == (1, 0)
    now[0] += 0.1
    # the worker may have read renewal 1 just now: it extends no further than the slack past the start's TTL
    assert run.lease_expires_in == pytest.approx(TTL * (1 + RENEWAL_SLACK) - 0.1)
    run.lease_renewed(1)
    assert run.lease_expires_in == pytest.approx(TTL)  # answered: a TTL from its answer
    assert run.next_renewal() == (2, 1) and run.next_renewal() == (3, 1)  # 2 was cut
    now[0] += 0.25
    assert run.lease_expires_in == pytest.approx(TTL * (1 + RENEWAL_SLACK) - 0.25)
    run.lease_renewed(3)
    assert run.lease_expires_in == pytest.approx(TTL)
