"""The pool's snapshots (as the policy places attempts over them), ejections and
cool-downs, on an injected clock; its probes over a replica client that only answers
(no I/O)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from app.config import ReplicaConfig
from app.replicas.base import ProbeAnswer, ReplicaClient, UpstreamFailure
from app.replicas.pool import ReplicaPool
from app.replicas.replica import Replica
from app.replicas.worker_errors import AttemptEnded, Rejected, ReplicaExited, RequestRefused, TokenRefused
from statemachine.events import FailureKind
from statemachine.routing import DEFAULT_ROUTING, place


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def pool(*ids: str, models: dict[str, tuple[str, ...]] | None = None, **options: Any) -> tuple[ReplicaPool, Clock]:
    clock = Clock()
    replicas = [
        Replica(ReplicaConfig(id=i, url=f"http://{i}", models=(models or {}).get(i, ())), cast(ReplicaClient, None))
        for i in ids
    ]
    return ReplicaPool(replicas, clock=clock, **options), clock


def choose(p: ReplicaPool, model: str, exclude: tuple[str, ...] = ()) -> str | None:
    """Place an attempt as the driver does: the policy's placement over the pool's snapshot."""
    placement = place(p.snapshot([model]), model, exclude, DEFAULT_ROUTING)
    if placement.replica is not None:
        p.placed(p.replicas[placement.replica])
    return placement.replica


def test_least_outstanding_first_then_the_one_idle_longest() -> None:
    p, _ = pool("a", "b", "c")
    p.replicas["a"].outstanding = 2
    assert [choose(p, "m") for _ in range(4)] == ["b", "c", "b", "c"]
    p.replicas["b"].outstanding = 5
    p.replicas["c"].outstanding = 5
    assert choose(p, "m") == "a"


def test_excluded_and_non_serving_replicas_are_never_chosen() -> None:
    p, _ = pool("a", "b", models={"a": ("other",)})
    assert choose(p, "m") == "b"
    assert choose(p, "m", ("b",)) is None
    assert choose(p, "other", ("b",)) == "a"


def test_failures_in_a_row_eject_with_a_doubling_back_off_and_success_resets() -> None:
    p, clock = pool("a", "b", eject_after_failures=2, ejection_s=5, ejection_max_s=12)
    a = p.replicas["a"]
    p.failed(a, "x")
    assert p.available(a) and a.healthy is None
    p.failed(a, "x")
    assert not p.available(a) and a.healthy is False and a.ejection_s == 5
    p.failed(a, "x")
    assert a.ejection_s == 10
    p.failed(a, "x")
    assert a.ejection_s == 12  # capped
    clock.now += 12.1
    assert p.available(a) is False  # still marked unhealthy until a probe succeeds
    p.succeeded(a)
    assert p.available(a) and a.consecutive_failures == 0 and a.ejection_s == 0


def test_retry_after_cools_a_replica_down_for_that_long() -> None:
    p, clock = pool("a", "b")
    p.cool_down(p.replicas["a"], 30)
    assert {choose(p, "m") for _ in range(3)} == {"b"}
    clock.now += 30
    assert choose(p, "m") == "a"


def test_health_changes_are_reported() -> None:
    p, _ = pool("a", eject_after_failures=1)
    seen: list[tuple[str, bool | None]] = []
    p.on_health_change = lambda replica: seen.append((replica.id, replica.healthy))
    p.succeeded(p.replicas["a"])
    p.failed(p.replicas["a"], "down")
    assert seen == [("a", True), ("a", False)]
    assert not p.any_available() and not p.any_available("m")


def test_what_counts_toward_ejection() -> None:
    p, clock = pool("a", eject_after_failures=2)
    (a,) = p.replicas.values()
    # the worker ended attempts by the protocol, at the gateway's doing: not the replica's fault
    for code in ("lease_expired", "lease_revoked", "cancelled"):
        p.observe(a, AttemptEnded("the attempt ended", code=code))
    p.observe(a, UpstreamFailure(FailureKind.OVERLOADED, "queued for 10s"))
    assert a.consecutive_failures == 0 and p.available(a)
    # a refused request says the replica is well
    p.observe(a, ReplicaExited("the stream ended"))
    p.observe(a, RequestRefused("prompt too long", status=400, code="prompt_too_long", field=None))
    assert a.consecutive_failures == 0
    # its own failures count, and Retry-After cools it down
    p.observe(a, Rejected("queue full", status=429, code="queue_full", retry_after=3.0))
    assert a.consecutive_failures == 1 and not p.available(a)
    clock.now += 3.0
    assert p.available(a)
    p.observe(a, UpstreamFailure(FailureKind.LIVENESS_UNCERTAIN, "no frame for 2s"))
    assert a.consecutive_failures == 2 and not p.available(a)  # ejected


@pytest.mark.parametrize("status", [400, 404, 409, 413, 422])
def test_a_4xx_about_the_request_never_counts_whatever_it_is_called(status: int) -> None:
    p, _ = pool("a", eject_after_failures=1)
    (a,) = p.replicas.values()
    for kind in (FailureKind.REPLICA_EXITED, FailureKind.REJECTED, FailureKind.LIVENESS_UNCERTAIN):
        p.observe(a, UpstreamFailure(kind, f"{status} for this request", status=status, code="invalid_field"))
    p.observe(a, RequestRefused("bad tool schema", status=status, code="invalid_field", field="params.tools"))
    assert a.consecutive_failures == 0 and p.available(a)


@pytest.mark.parametrize("status", [401, 408, 429, 500, 503])
def test_a_replica_side_status_counts(status: int) -> None:
    p, _ = pool("a", eject_after_failures=1)
    (a,) = p.replicas.values()
    failure = (
        TokenRefused("wrong worker token", status=401, code="unauthorized")
        if status == 401
        else Rejected("replica side", status=status, code=None, retry_after=None)
    )
    p.observe(a, failure)
    assert a.consecutive_failures == 1 and not p.available(a)


# --- probes: a silence counts, unless the replica streams frames meanwhile --------------


class Probed:
    """A replica client whose probes get ``answer`` after a short wait, while ``streaming``
    (when set) reads frames from the replica's live attempts."""

    def __init__(self, answer: ProbeAnswer, reported_load: int | None = None) -> None:
        self.answer = answer
        self.streaming: Replica | None = None
        self.reported_load = reported_load

    async def health(self) -> ProbeAnswer:
        await asyncio.sleep(0.01)
        if self.streaming is not None:
            self.streaming.frames_read += 3
        return self.answer


def probed(answer: ProbeAnswer, *, streaming: bool) -> tuple[ReplicaPool, Replica]:
    client = Probed(answer)
    replica = Replica(ReplicaConfig(id="a", url="http://a"), cast(ReplicaClient, client))
    client.streaming = replica if streaming else None
    return ReplicaPool([replica], eject_after_failures=1), replica


@pytest.mark.parametrize("answer", [ProbeAnswer.SILENT, ProbeAnswer.UNHEALTHY])
async def test_a_failed_probe_of_a_replica_that_streams_nothing_ejects(answer: ProbeAnswer) -> None:
    p, a = probed(answer, streaming=False)
    assert await p.probe(a) is False
    assert a.consecutive_failures == 1 and a.healthy is False and not p.available(a)


async def test_a_silent_probe_does_not_count_while_the_replica_streams_frames() -> None:
    p, a = probed(ProbeAnswer.SILENT, streaming=True)
    await p.probe_all()
    assert a.consecutive_failures == 0 and p.available(a)


async def test_an_unhealthy_answer_counts_even_while_the_replica_streams() -> None:
    p, a = probed(ProbeAnswer.UNHEALTHY, streaming=True)  # it answered: no benefit of the doubt
    await p.probe(a)
    assert a.consecutive_failures == 1 and not p.available(a)


def test_a_probe_takes_the_load_the_replica_reports_into_the_snapshot() -> None:
    p, clock = pool("a", "b")
    a, b = p.replicas["a"], p.replicas["b"]
    a.outstanding = 1
    a.client = cast(ReplicaClient, Probed(ProbeAnswer.HEALTHY, reported_load=7))  # 6 of them other gateways'
    asyncio.run(p.probe(a))
    b.outstanding = 2
    p.cool_down(b, 1.5)
    assert [view.id for view in p.snapshot(["m"]).replicas] == ["a"]  # b cannot take it: not shown
    views = {view.id: view for view in p.snapshot(["m"], keep=["b"]).replicas}  # shown: the request tried it
    assert (views["a"].others_load, views["a"].load, views["a"].available) == (6, 7, True)
    assert (views["b"].outstanding, views["b"].cooldown_s, views["b"].available) == (2, 1.5, False)
    clock.now += 1.5
    assert choose(p, "m") == "b"  # cooled down: 2 outstanding here is less than a's 7
    a.outstanding = 0  # a's attempt here ended since: its load is the others' 6, not the stale 7
    assert p.snapshot(["m"]).replicas[0].load == 6
    b.outstanding = 1
    p.queued_at(b, 5)  # a heartbeat: one of ours waits fifth in b's queue, so 4 others at least
    assert p.snapshot(["m"]).replicas[1].others_load == 4
    p.queued_at(b, 2)  # a lower bound never lowers what is known
    assert p.snapshot(["m"]).replicas[1].others_load == 4
