"""Where attempts go (docs/routing.md): the strategies over a pool snapshot, the same-replica
retry after a ``Retry-After``, model fallbacks, and replay of every placement."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from statemachine import events as ev
from statemachine.actions import FailRequest, StartAttempt, WaitToRetry
from statemachine.errors import IllegalTransition
from statemachine.events import FailureKind
from statemachine.policy_config import PolicyConfig
from statemachine.replay import replay
from statemachine.request_state import Outcome
from statemachine.routing import (
    DEFAULT_ROUTING,
    PoolSnapshot,
    ReplicaView,
    RoutingConfig,
    Strategy,
    place,
)
from tests.statemachine.model import ModelDriver

AFFINITY = RoutingConfig(strategy=Strategy.PREFIX_AFFINITY)


def snapshot(*views: ReplicaView, placements: int = 0) -> PoolSnapshot:
    return PoolSnapshot(views, placements)


# --- the strategies ---------------------------------------------------------------------


def test_least_outstanding_counts_the_other_gateways_load_a_replica_reports() -> None:
    pool = snapshot(ReplicaView("a", outstanding=1), ReplicaView("b", outstanding=0, others_load=4))
    assert place(pool, "m", (), DEFAULT_ROUTING).replica == "a"  # b holds 4 of other gateways'


def test_unavailable_excluded_and_non_serving_replicas_are_never_placed() -> None:
    pool = snapshot(
        ReplicaView("a", available=False),
        ReplicaView("b", models=("other",)),
        ReplicaView("c"),
    )
    assert place(pool, "m", (), DEFAULT_ROUTING).replica == "c"
    none = place(pool, "m", ("c",), DEFAULT_ROUTING)
    assert none.replica is None and "no available replica serves m" in none.why


def test_round_robin_takes_turns_by_the_gateways_placement_count() -> None:
    config = RoutingConfig(strategy=Strategy.ROUND_ROBIN)
    views = (ReplicaView("b", outstanding=9), ReplicaView("a"), ReplicaView("c"))
    turns = [place(snapshot(*views, placements=n), "m", (), config).replica for n in range(4)]
    assert turns == ["a", "b", "c", "a"]  # load is not looked at


def test_prefix_affinity_keeps_a_conversation_on_one_replica_and_spreads_conversations() -> None:
    views = tuple(ReplicaView(name) for name in ("a", "b", "c", "d"))
    homes = {f"conversation-{n}": place(snapshot(*views), "m", (), AFFINITY, f"conversation-{n}") for n in range(200)}
    assert all(p.why == "prefix_affinity" for p in homes.values())
    spread = Counter(p.replica for p in homes.values())
    assert set(spread) == {"a", "b", "c", "d"} and min(spread.values()) >= 30  # rendezvous hashing spreads them
    key = "conversation-7"
    again = place(snapshot(*reversed(views)), "m", (), AFFINITY, key)
    assert again.replica == homes[key].replica  # the order the pool lists them in does not matter


def test_prefix_affinity_passes_over_a_preferred_replica_above_its_load_bound() -> None:
    key = "conversation-1"
    views = (ReplicaView("a"), ReplicaView("b"), ReplicaView("c"))
    home = place(snapshot(*views), "m", (), AFFINITY, key).replica
    assert home is not None
    loaded = tuple(dataclasses.replace(v, outstanding=6) if v.id == home else v for v in views)
    moved = place(snapshot(*loaded), "m", (), AFFINITY, key)
    # the bound: ceil(1.25 * (6 + 1) / 3) + 1 = 4; the home's 6 + 1 is over it
    assert moved.replica != home and moved.why.endswith("over its load bound")
    near = tuple(dataclasses.replace(v, outstanding=1) if v.id == home else v for v in views)
    assert place(snapshot(*near), "m", (), AFFINITY, key).replica == home  # within the bound: it stays


def test_prefix_affinity_without_a_key_is_least_outstanding() -> None:
    pool = snapshot(ReplicaView("a", outstanding=3), ReplicaView("b"))
    assert place(pool, "m", (), AFFINITY, None) == place(pool, "m", (), DEFAULT_ROUTING)


def test_a_snapshot_and_a_routing_config_survive_their_json_form() -> None:
    pool = snapshot(ReplicaView("a", ("m",), False, 2, 5, 1.5, 3), ReplicaView("b"), placements=9)
    assert PoolSnapshot.from_params(pool.to_params()) == pool
    assert pool.to_params()["replicas"][1] == {"id": "b"}  # defaults left out: it is on every start
    config = RoutingConfig(Strategy.ROUND_ROBIN, 1.5, 1.0, ("x",), ("y", "z"), ())
    assert RoutingConfig.from_params(config.to_params()) == config
    assert RoutingConfig.from_params(config.to_params(compact=True)) == config
    assert DEFAULT_ROUTING.to_params(compact=True) == {"strategy": "prefix_affinity"}


def test_routing_configs_built_from_params_are_kept_and_the_kept_ones_stay_few() -> None:
    params = {"strategy": "round_robin", "fallbacks": ["x"]}
    first = RoutingConfig.from_params(params)
    assert RoutingConfig.from_params(dict(params)) is first  # built once
    assert RoutingConfig.from_params({"strategy": "round_robin", "fallbacks": ("x",)}) == first
    for factor in range(100):  # more configurations than are kept
        assert RoutingConfig.from_params({"affinity_load_factor": 1 + factor}).affinity_load_factor == 1 + factor
    assert RoutingConfig.from_params(params) == first
    compact = first.to_params(compact=True)
    compact["strategy"] = "changed"  # a copy: what the next request records is unchanged
    assert first.to_params(compact=True) == {"strategy": "round_robin", "fallbacks": ["x"]}
    with pytest.raises(ValueError, match="a list of model names"):
        RoutingConfig.from_params({"fallbacks": [["x"]]})  # not hashable: built, refused, not kept


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"strategy": "fastest"}, "strategy must be one of least_outstanding, prefix_affinity, round_robin"),
        ({"affinity_load_factor": 0.5}, "at least 1"),
        ({"retry_same_max_wait_s": -1}, "between 0 and 60"),
        ({"fallbacks": "big"}, "a list of model names"),
        ({"fallback": ["big"]}, "unknown routing settings: fallback"),
    ],
)
def test_a_routing_config_is_validated(params: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RoutingConfig.from_params(params)


# --- the same replica after its Retry-After -----------------------------------------------


def one_replica(**accepted: object) -> ModelDriver:
    return ModelDriver(replicas=("w1",), **accepted)


def test_a_429_with_a_short_retry_after_waits_and_retries_on_the_same_replica() -> None:
    driver = one_replica()
    actions = driver.fail(FailureKind.REJECTED, upstream_status=429, retry_after_s=1.5)
    wait, start = actions
    assert isinstance(wait, WaitToRetry) and (wait.replica, wait.wait_s) == ("w1", 1.5)
    assert isinstance(start, StartAttempt) and start.replica == "w1" and start.attempt == 2
    assert start.placement.startswith("same replica")
    kinds = [type(e).__name__ for e in driver.events[-5:]]
    assert kinds == ["UpstreamFailed", "Decided", "RetryWaitElapsed", "Decided", "AttemptStarted"]
    driver.deliver(2)
    driver.complete()
    assert replay(driver.events).ok


def test_a_429_waits_for_its_replica_only_when_no_other_is_healthier() -> None:
    idle_other = ModelDriver(replicas=("w1", "w2"))
    (start,) = idle_other.fail(FailureKind.REJECTED, upstream_status=429, retry_after_s=1.0)
    assert isinstance(start, StartAttempt) and start.replica == "w2"
    assert "w2 is available and no more loaded than w1" in start.placement

    busy_other = ModelDriver(replicas=("w1", "w2"))
    busy_other.pool = snapshot(ReplicaView("w1"), ReplicaView("w2", outstanding=3))
    wait, start = busy_other.fail(FailureKind.REJECTED, upstream_status=429, retry_after_s=1.0)
    assert isinstance(wait, WaitToRetry) and isinstance(start, StartAttempt) and start.replica == "w1"


@pytest.mark.parametrize(
    ("failure", "why"),
    [
        ({"upstream_status": 429, "retry_after_s": 30.0}, "Retry-After 30s is over retry_same_max_wait_s 2s"),
        ({"upstream_status": 429}, "the 429 gave no Retry-After"),
    ],
)
def test_otherwise_the_attempt_fails_over_and_says_why(failure: dict[str, object], why: str) -> None:
    driver = ModelDriver(replicas=("w1", "w2"))
    driver.pool = snapshot(ReplicaView("w1"), ReplicaView("w2", outstanding=3))
    (start,) = driver.fail(FailureKind.REJECTED, **failure)
    assert isinstance(start, StartAttempt) and start.replica == "w2" and why in start.placement


def test_one_server_error_is_retried_on_the_same_replica_at_once_and_a_second_is_poison() -> None:
    driver = ModelDriver(replicas=("w1",), config=PolicyConfig(max_attempts=3))
    (start,) = driver.fail(FailureKind.REJECTED, upstream_status=500)
    assert isinstance(start, StartAttempt) and start.replica == "w1" and "waited 0s" in start.placement
    (poison,) = driver.fail(FailureKind.REJECTED, upstream_status=500)
    assert isinstance(poison, FailRequest) and poison.code == "poison_request"


def test_the_same_replica_retry_is_bounded_by_max_attempts() -> None:
    driver = one_replica()  # max_attempts 2
    driver.fail(FailureKind.REJECTED, upstream_status=429, retry_after_s=1.0)
    (failed,) = driver.fail(FailureKind.REJECTED, upstream_status=429, retry_after_s=1.0)
    assert isinstance(failed, FailRequest) and failed.code == "upstream_unavailable"


def test_a_replica_that_left_the_pool_during_the_wait_is_not_retried() -> None:
    driver = one_replica()
    driver.pool = snapshot(ReplicaView("w1", cooldown_s=1.0, available=False), ReplicaView("w9", models=("x",)))
    actions = driver.fail(FailureKind.REJECTED, upstream_status=429, retry_after_s=1.0)
    # decided while w1 cools down (the wait is the cool-down); after it w1 is still out
    assert isinstance(actions[0], WaitToRetry)
    refused = [e for e in driver.events if isinstance(e, ev.NoReplicaAvailable)]
    assert refused and driver.state.outcome is Outcome.FAILED


# --- model fallbacks ----------------------------------------------------------------------

FALLBACK_POOL = snapshot(ReplicaView("small-1", ("tiny",)), ReplicaView("big-1", ("big",)))


def test_context_length_exceeded_moves_to_the_context_window_fallback() -> None:
    driver = ModelDriver(pool=FALLBACK_POOL, routing={"context_window_fallbacks": ["big"]})
    (start,) = driver.fail(FailureKind.REQUEST_REFUSED, upstream_status=400, upstream_code="context_length_exceeded")
    assert isinstance(start, StartAttempt)
    assert (start.model, start.replica, start.migration) == ("big", "big-1", "model_fallback")
    assert "fallback from tiny after context_length_exceeded" in start.placement
    assert driver.state.current_attempt is not None and driver.state.current_attempt.model == "big"
    driver.deliver(2)
    driver.complete()
    assert driver.state.answered_by == "big"
    assert replay(driver.events).ok


def test_a_refusal_with_no_fallback_left_is_the_original_error_unchanged() -> None:
    driver = ModelDriver(pool=FALLBACK_POOL, routing={"context_window_fallbacks": ["big"]})
    refusal = {"upstream_status": 400, "upstream_code": "context_length_exceeded"}
    driver.fail(FailureKind.REQUEST_REFUSED, **refusal)
    (failed,) = driver.fail(FailureKind.REQUEST_REFUSED, **refusal)  # the fallback refuses it too
    assert isinstance(failed, FailRequest)
    assert (failed.code, failed.http_status, failed.retryable) == ("context_length_exceeded", 400, False)


def test_a_content_policy_refusal_takes_its_own_list_and_other_refusals_none() -> None:
    routing = {"content_policy_fallbacks": ["big"], "fallbacks": ["big"]}
    driver = ModelDriver(pool=FALLBACK_POOL, routing=routing)
    (start,) = driver.fail(FailureKind.REQUEST_REFUSED, upstream_status=400, upstream_code="content_policy_violation")
    assert isinstance(start, StartAttempt) and start.model == "big"

    other = ModelDriver(pool=FALLBACK_POOL, routing=routing)
    (failed,) = other.fail(FailureKind.REQUEST_REFUSED, upstream_status=400, upstream_code="invalid_value")
    assert isinstance(failed, FailRequest) and failed.code == "invalid_value"  # a bad request is not retried


def test_fallbacks_follow_the_models_own_retries_and_each_model_gets_max_attempts() -> None:
    pool = snapshot(ReplicaView("s1", ("tiny",)), ReplicaView("s2", ("tiny",)), ReplicaView("b1", ("big",)))
    driver = ModelDriver(pool=pool, routing={"fallbacks": ["big"]})
    (retry,) = driver.fail(FailureKind.REPLICA_EXITED)
    assert isinstance(retry, StartAttempt) and retry.model == "tiny"  # the model's own retry first
    (fallback,) = driver.fail(FailureKind.REPLICA_EXITED)
    assert isinstance(fallback, StartAttempt) and (fallback.model, fallback.replica) == ("big", "b1")
    assert "after its retries were spent" in fallback.placement
    driver.fail(FailureKind.REPLICA_EXITED)  # big's one replica tried: nothing is left
    assert driver.state.outcome is Outcome.FAILED and driver.state.error_code == "no_replica_available"
    assert [a.model for a in driver.state.attempts] == ["tiny", "tiny", "big"]


def test_no_replica_for_the_model_falls_back_at_once() -> None:
    pool = snapshot(ReplicaView("s1", ("tiny",), available=False), ReplicaView("b1", ("big",)))
    driver = ModelDriver(pool=pool, routing={"fallbacks": ["big"]})
    assert [a.model for a in driver.state.attempts] == ["big"]
    assert any(isinstance(e, ev.NoReplicaAvailable) for e in driver.events)


def test_no_fallback_after_the_first_delivered_delta() -> None:
    driver = ModelDriver(pool=FALLBACK_POOL, routing={"fallbacks": ["big"]})
    driver.deliver(1)
    (failed,) = driver.fail(FailureKind.REPLICA_EXITED)
    assert isinstance(failed, FailRequest) and failed.code == "upstream_decode_interrupted"


# --- replay reproduces every placement ------------------------------------------------------


def test_a_placement_recorded_elsewhere_than_the_snapshot_says_is_named_as_the_divergence() -> None:
    driver = ModelDriver(replicas=("w1", "w2", "w3"))
    driver.pool = snapshot(ReplicaView("w1"), ReplicaView("w2", outstanding=5), ReplicaView("w3"))
    driver.fail(FailureKind.REPLICA_EXITED)
    driver.deliver(1)
    driver.complete()
    assert replay(driver.events).ok
    assert [a.replica_id for a in driver.state.attempts] == ["w1", "w3"]
    # a gateway that placed the retry on w2 although its snapshot showed w2 the busier
    tampered = [
        dataclasses.replace(e, params={**e.params, "replica": "w2"})
        if isinstance(e, ev.Decided) and e.params.get("attempt") == 2
        else e
        for e in driver.events
    ]
    result = replay(tampered)
    assert not result.ok and result.divergence is not None
    (recorded,) = result.divergence.recorded
    (recomputed,) = result.divergence.recomputed
    assert (recorded["params"]["replica"], recomputed["params"]["replica"]) == ("w2", "w3")


# --- the fold's side ----------------------------------------------------------------------


def test_a_retry_wait_that_was_never_decided_is_illegal() -> None:
    driver = ModelDriver()
    with pytest.raises(IllegalTransition, match="no wait to retry was decided"):
        driver.record(ev.RetryWaitElapsed, replica_id="w1")


def test_a_request_accepted_with_routing_that_cannot_be_is_illegal() -> None:
    with pytest.raises(IllegalTransition, match="routing: strategy must be one of"):
        ModelDriver(routing={"strategy": "fastest"})


def test_a_fallback_pays_the_cost_guard_like_any_retry() -> None:
    driver = ModelDriver(
        pool=FALLBACK_POOL,
        config=PolicyConfig(retry_max_prompt_tokens=5),  # the model driver's prompt is 12 tokens
        routing={"context_window_fallbacks": ["big"]},
    )
    (failed,) = driver.fail(FailureKind.REQUEST_REFUSED, upstream_status=400, upstream_code="context_length_exceeded")
    assert isinstance(failed, FailRequest) and failed.code == "retry_cost_exceeded"


def test_a_fallback_chain_skips_the_models_already_tried() -> None:
    driver = ModelDriver(pool=FALLBACK_POOL, routing={"context_window_fallbacks": ["tiny", "big"]})
    (start,) = driver.fail(FailureKind.REQUEST_REFUSED, upstream_status=400, upstream_code="context_length_exceeded")
    assert isinstance(start, StartAttempt) and start.model == "big"  # "tiny" is the model that refused


def test_a_replica_gone_from_the_pool_is_not_waited_for() -> None:
    driver = ModelDriver(pool=snapshot(ReplicaView("w1"), ReplicaView("w2", outstanding=4)))
    driver.pool = snapshot(ReplicaView("w2", outstanding=4))  # w1 was removed meanwhile
    (start,) = driver.fail(FailureKind.REJECTED, upstream_status=429, retry_after_s=1.0)
    assert isinstance(start, StartAttempt) and start.replica == "w2" and "w1 left the pool" in start.placement
