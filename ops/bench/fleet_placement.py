"""Placement over a large fleet: the cost of one placement and the bytes a ``Decided`` records.

    python ops/bench/fleet_placement.py [--replicas 200] [--requests 20000] [--changes-per-s 10]

In one process, with no I/O: a pool of ``--replicas`` replicas (each with a client that
is never called) serving one model, loads spread over them. Each request takes the
pool's snapshot as the driver does (``ReplicaPool.snapshot``: the candidates at the
request's revision, bounded) and the policy places it over it (``statemachine.routing.place``,
prefix affinity with a key of its own), the chosen replica then counted as placed. Fleet
changes arrive at ``--changes-per-s`` as the fleet keeper applies them (a cordon or an
uncordon of a random replica, so the snapshot's cached list of serving replicas is found
again), timed on the requests' own clock: ``--requests`` placements spread over the
seconds a gateway at 1,000 placements a second would take. It prints, per strategy,
the placement cost (snapshot and place, median and p99, microseconds) and the bytes of
the snapshot's JSON on the ``Decided`` event (median and largest). The propagation of a
change between instances is measured by the tests (tests/app/driver/test_fleet_changes.py)
and its figures are in docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any, cast

from app.config import ReplicaConfig
from app.replicas.base import ReplicaClient
from app.replicas.pool import ReplicaPool
from app.replicas.replica import Replica
from statemachine.routing import RoutingConfig, Strategy, place

MODEL = "m"


def fleet(count: int) -> ReplicaPool:
    replicas = [
        Replica(ReplicaConfig(id=f"r{n:03d}", url=f"http://r{n}", models=(MODEL,)), cast(ReplicaClient, None))
        for n in range(count)
    ]
    return ReplicaPool(replicas)


def run(strategy: Strategy, replicas: int, requests: int, changes_per_s: float, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    pool = fleet(replicas)
    for replica in pool.replicas.values():
        replica.outstanding = rng.randrange(0, 8)
    routing = RoutingConfig(strategy=strategy)
    ids = list(pool.replicas)
    costs, sizes = [], []
    every = max(int(1000 / changes_per_s), 1) if changes_per_s > 0 else 0  # placements between two changes
    for n in range(requests):
        if every and n % every == 0:  # a change, as the keeper applies it
            replica = pool.replicas[rng.choice(ids)]
            replica.cordoned = not replica.cordoned
            pool.admit(replica)
        # the key is recorded (and passed) under prefix affinity only, as the driver does
        key = f"conversation-{rng.randrange(requests // 4 or 1)}" if strategy is Strategy.PREFIX_AFFINITY else None
        started = time.perf_counter()
        snapshot = pool.snapshot([MODEL], revisions={MODEL: None}, keep=(), affinity_key=key)
        placement = place(snapshot, MODEL, (), routing, key)
        costs.append((time.perf_counter() - started) * 1e6)
        if placement.replica is not None:
            chosen = pool.replicas[placement.replica]
            pool.placed(chosen)
            chosen.outstanding += 1
            done = pool.replicas[rng.choice(ids)]  # another attempt ends somewhere
            done.outstanding = max(done.outstanding - 1, 0)
        if n % 97 == 0:
            sizes.append(len(json.dumps(snapshot.to_params())))
    costs.sort()
    return {
        "strategy": strategy.value,
        "placement_us_p50": round(statistics.median(costs), 1),
        "placement_us_p99": round(costs[int(len(costs) * 0.99)], 1),
        "decided_pool_bytes_p50": int(statistics.median(sizes)),
        "decided_pool_bytes_max": max(sizes),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=200)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--changes-per-s", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    for strategy in Strategy:
        print(json.dumps(run(strategy, args.replicas, args.requests, args.changes_per_s, args.seed)))


if __name__ == "__main__":
    main()
