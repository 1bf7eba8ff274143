"""Which failures count toward ejection: a poison request's server errors never do."""

from __future__ import annotations

from typing import cast

from app.config import ReplicaConfig
from app.driver.charges import FailureCharges
from app.replicas.base import ReplicaClient
from app.replicas.pool import ReplicaPool
from app.replicas.replica import Replica
from app.replicas.worker_errors import AttemptEnded, ConnectFailed, Rejected


def pool() -> ReplicaPool:
    replicas = [Replica(ReplicaConfig(id=i, url=f"http://{i}"), cast(ReplicaClient, None)) for i in ("a", "b")]
    return ReplicaPool(replicas, clock=lambda: 100.0, eject_after_failures=1)


def internal_error() -> Rejected:
    return Rejected("500: boom", status=500, code="internal_error", retry_after=None)


def engine_error() -> AttemptEnded:
    return AttemptEnded("the engine failed", code="engine_error")


def test_a_poison_requests_server_errors_count_toward_no_ejection() -> None:
    p = pool()
    charges = FailureCharges(p, "req_1")
    charges.observe(p.replicas["a"], internal_error())
    charges.observe(p.replicas["b"], engine_error())
    charges.settle(poison=True)
    charges.settle(poison=False)  # nothing is left to count afterwards
    assert [r.consecutive_failures for r in p.replicas.values()] == [0, 0]
    assert all(p.available(r) for r in p.replicas.values())


def test_held_server_errors_count_once_the_request_proves_not_poison() -> None:
    p = pool()
    charges = FailureCharges(p, "req_1")
    charges.observe(p.replicas["a"], engine_error())
    assert p.replicas["a"].consecutive_failures == 0  # held until the request shows what it was
    charges.settle(poison=False)
    assert p.replicas["a"].consecutive_failures == 1 and not p.available(p.replicas["a"])
    charges.settle(poison=False)
    assert p.replicas["a"].consecutive_failures == 1  # counted once


def test_other_failures_count_at_once() -> None:
    p = pool()
    charges = FailureCharges(p, "req_1")
    charges.observe(p.replicas["a"], ConnectFailed("refused"))
    charges.observe(p.replicas["b"], Rejected("503", status=503, code="not_ready", retry_after=None))
    assert [r.consecutive_failures for r in p.replicas.values()] == [1, 1]
    charges.settle(poison=True)  # nothing held: a poison verdict forgives only server errors
    assert [r.consecutive_failures for r in p.replicas.values()] == [1, 1]
