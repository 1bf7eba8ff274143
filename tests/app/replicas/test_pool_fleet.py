"""The pool as the fleet changes (docs/design.md §16): replicas admitted and retired at run
time, cordons and revisions seen by the policy through the snapshot, and a snapshot that
stays small at fleet scale while replay stays exact."""

from __future__ import annotations

import asyncio
import json
from typing import Any, cast

from app.config import ReplicaConfig
from app.replicas.base import ReplicaClient
from app.replicas.pool import ReplicaPool
from app.replicas.replica import Replica
from statemachine.actions import StartAttempt
from statemachine.events import Decided, FailureKind
from statemachine.replay import replay
from statemachine.routing import DEFAULT_ROUTING, RoutingConfig, Strategy, place
from tests.statemachine.model import ModelDriver


class Closing:
    closed = False

    async def close(self) -> None:
        self.closed = True


def member(replica_id: str, **options: Any) -> Replica:
    config = ReplicaConfig(id=replica_id, url=f"http://{replica_id}", **options)
    return Replica(config, cast(ReplicaClient, Closing()))


def fleet(count: int, **options: Any) -> ReplicaPool:
    return ReplicaPool([member(f"r{n:03d}", **options) for n in range(count)])


def test_replicas_are_admitted_cordoned_and_retired_without_touching_live_attempts() -> None:
    pool = ReplicaPool([member("a")])
    assert place(pool.snapshot(["m"]), "m", (), DEFAULT_ROUTING).replica == "a"
    pool.admit(member("b"))
    a, b = pool.replicas["a"], pool.replicas["b"]
    a.outstanding = 3
    assert place(pool.snapshot(["m"]), "m", (), DEFAULT_ROUTING).replica == "b"
    b.cordoned = True
    pool.admit(b)  # as the fleet keeper applies a cordon: the snapshot is found again
    snapshot = pool.snapshot(["m"])
    assert [view.id for view in snapshot.replicas] == ["a"]
    assert place(snapshot, "m", (), DEFAULT_ROUTING).replica == "a"
    kept = pool.snapshot(["m"], keep=["b"]).view("b")
    assert kept is not None and kept.cordoned and not kept.takes_new  # the policy sees why
    assert not pool.unready()  # a is a serving member and available
    retired = pool.retire("a")
    assert retired is a and "a" not in pool.replicas and a.cordoned
    asyncio.run(pool.reap())
    assert pool.retired == [a] and not cast(Closing, a.client).closed  # its 3 attempts run on
    a.outstanding = 0
    asyncio.run(pool.reap())
    assert pool.retired == [] and cast(Closing, a.client).closed
    assert place(pool.snapshot(["m"]), "m", (), DEFAULT_ROUTING).replica is None  # b cordoned
    assert not pool.unready()  # every member cordoned: ready, requests get no_replica_available


def test_a_replica_of_another_revision_gets_no_attempt_for_that_model() -> None:
    pool = ReplicaPool(
        [
            member("old", models=("m", "n"), revisions=(("m", "A"),)),
            member("new", models=("m",), revisions=(("m", "B"),)),
            member("any", models=("n",)),
        ]
    )
    pool.replicas["new"].outstanding = 5  # the least loaded of m's replicas is at the other revision
    at_a = pool.snapshot(["m"], revisions={"m": "A"})
    assert place(at_a, "m", (), DEFAULT_ROUTING).replica == "old"
    at_b = pool.snapshot(["m"], revisions={"m": "B"})
    assert [view.id for view in at_b.replicas] == ["new"]
    assert place(at_b, "m", ("new",), DEFAULT_ROUTING).replica is None  # never onto other weights
    both = pool.snapshot(["m", "n"], revisions={"m": "B", "n": None})
    views = {view.id: view for view in both.replicas}
    assert views["old"].models == ("n",) and views["new"].models == ("m",) and views["any"].models == ("n",)
    assert place(both, "n", (), DEFAULT_ROUTING).replica in {"old", "any"}


def snapshot_bytes(driver: ModelDriver) -> list[int]:
    return [len(json.dumps(e.params["pool"])) for e in driver.events if isinstance(e, Decided) and "pool" in e.params]


def test_at_200_replicas_a_decided_stays_under_a_kilobyte_and_replays_exactly() -> None:
    for strategy in Strategy:
        pool = fleet(200, models=("m",))
        for n, replica in enumerate(pool.replicas.values()):
            replica.outstanding = (n * 7) % 5  # loads spread, ties broken by who was chosen last
            replica.last_chosen = n % 13
        routing = RoutingConfig(strategy=strategy)
        snapshot = pool.snapshot(["m"], revisions={"m": "sim-1"}, affinity_key="conversation-1")
        driver = ModelDriver(replicas=(), pool=snapshot, routing=routing.to_params(), affinity_key="conversation-1")
        first = driver.state.current_attempt
        assert first is not None
        driver.pool = pool.snapshot(["m"], keep=driver.state.replicas_tried, affinity_key="conversation-1")
        (retry,) = driver.fail(FailureKind.REPLICA_EXITED)
        assert isinstance(retry, StartAttempt) and retry.replica not in (None, first.replica_id)
        sizes = snapshot_bytes(driver)
        assert len(sizes) == 2 and max(sizes) < 1024, (strategy, sizes)
        result = replay(driver.events)
        assert result.divergence is None and result.decisions >= 2
    # least outstanding chooses as it would over the whole fleet
    pool = fleet(200)
    for n, replica in enumerate(pool.replicas.values()):
        replica.outstanding = 0 if n == 157 else 2
    assert place(pool.snapshot(["m"]), "m", (), DEFAULT_ROUTING.__class__()).replica == "r157"
    affinity = RoutingConfig(strategy=Strategy.PREFIX_AFFINITY)
    full = place(pool.snapshot(["m"], affinity_key="k"), "m", (), affinity, "k")
    assert full.replica is not None and full.why == "prefix_affinity"  # the preferred replica is shown
