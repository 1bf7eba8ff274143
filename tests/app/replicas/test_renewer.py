"""The per-replica lease renewer's rounds, with a scripted replica (timing and bookkeeping only;
renewals over a real worker are in tests/app/driver/test_leases.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from app.replicas.base import AttemptRequest
from app.replicas.renewer import LeaseRenewer
from tests.support.waiting import until

TTL = 0.3  # a round every 0.1 s


class ScriptedReplica:
    replica_id = "r1"

    def __init__(self, answers: list[Any]) -> None:
        self.answers = answers  # per round: a list of booleans, or an exception to raise
        self.rounds: list[list[str]] = []

    async def renew_all(self, requests: Sequence[AttemptRequest]) -> list[bool]:
        self.rounds.append([r.request_id for r in requests])
        answer = self.answers[min(len(self.rounds), len(self.answers)) - 1]
        if isinstance(answer, Exception):
            raise answer
        return list(answer)


class Held:
    def __init__(self, request_id: str) -> None:
        self.request = AttemptRequest(request_id, 1, 1, TTL, "chat.completions", "m", None, "p", {})
        self.renewals = 0

    def lease_renewed(self) -> None:
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
