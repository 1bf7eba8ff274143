"""The declared sources' seam (app/replicas/declared.py): each source's set replaces what it
declared before, the pool is their union, a replica that leaves keeps its live attempts
and its client closes once they ended, one whose settings changed is replaced."""

from __future__ import annotations

import asyncio
from typing import Any

from app.config import ReplicaConfig
from app.discover_config import parse_discover
from app.replicas.base import ReplicaClient
from app.replicas.declared import DeclaredReplicas, dns_replicas
from app.replicas.pool import Replica, ReplicaPool
from app.replicas.worker import WorkerReplica


def seam(*started: ReplicaConfig) -> tuple[DeclaredReplicas, ReplicaPool, list[asyncio.Task[Any]]]:
    def client(config: ReplicaConfig) -> ReplicaClient:
        return WorkerReplica(config.id, config.url, connect_timeout_s=0.2)

    pool = ReplicaPool([Replica(config, client(config)) for config in started])
    tasks: list[asyncio.Task[Any]] = []
    return (
        DeclaredReplicas(pool, client, lambda coro, name: tasks.append(asyncio.ensure_future(coro)), started),
        pool,
        tasks,
    )


async def test_each_source_replaces_its_own_set_and_the_pool_is_their_union() -> None:
    w1, w2 = ReplicaConfig("w1", "http://127.0.0.1:9"), ReplicaConfig("w2", "http://127.0.0.1:10")
    declared, pool, tasks = seam(w1)
    kept = pool.replicas["w1"]
    (entry,) = parse_discover([{"name": "vllm.test", "port": 9, "kind": "openai", "models": ["tiny=r1"]}])
    declared.on_declared_replicas("dns", dns_replicas(entry, {("127.0.0.5", 9), ("::1", 9)}), scope="vllm.test")
    assert list(pool.replicas) == ["w1", "127.0.0.5:9", "[::1]:9"]
    assert pool.replicas["w1"] is kept  # unchanged: the same replica, its counts and health kept
    discovered = pool.replicas["[::1]:9"].config
    assert (discovered.url, discovered.kind, discovered.models) == ("http://[::1]:9", "openai", ("tiny",))
    assert [r.id for r in pool.snapshot(["tiny"]).replicas] == ["w1", "127.0.0.5:9", "[::1]:9"]
    await asyncio.gather(*tasks)  # their first probes: nothing answers there
    declared.on_declared_replicas("file", [w2])  # the file's set, reloaded: w1 leaves, w2 joins
    assert list(pool.replicas) == ["w2", "127.0.0.5:9", "[::1]:9"]
    declared.forget("dns", "vllm.test")
    assert list(pool.replicas) == ["w2"]
    await asyncio.gather(*tasks)  # the joiners' first probes, the leavers' closes
    assert pool.replicas["w2"].consecutive_failures == 1  # probed as it joined: nothing answers there
    await pool.close()


async def test_a_replica_that_leaves_keeps_its_attempts_and_one_that_changed_is_replaced() -> None:
    w1 = ReplicaConfig("w1", "http://127.0.0.1:9")
    declared, pool, tasks = seam(w1)
    old = pool.replicas["w1"]
    old.outstanding = 1  # a live attempt holds it
    declared.on_declared_replicas("file", [ReplicaConfig("w1", "http://127.0.0.1:11")])
    assert pool.replicas["w1"] is not old and pool.replicas["w1"].config.url == "http://127.0.0.1:11"
    closing = tasks[0]
    await asyncio.sleep(0.05)
    assert not closing.done()  # its client stays open while the attempt runs
    old.outstanding = 0
    await asyncio.wait_for(closing, 5)
    await asyncio.gather(*tasks)
    await pool.close()
