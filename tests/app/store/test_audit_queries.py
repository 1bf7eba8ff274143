"""Every query of docs/audit.md runs against a realistic log and returns what it should.

The queries are read from the document itself, so the document and this test cannot
drift apart: a query without an expectation here, or an expectation without its
query, fails.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

from app.store import PostgresEventStore
from app.store.database import asyncpg_dsn
from app.store.fleet import FleetStore
from app.store.fleet_model import DeclaredReplica
from app.store.instances import InstanceInfo, InstanceRegistry
from ops import traces
from ops.audit_queries import bind, bounded_queries, doc_queries, index_name
from statemachine.events import (
    AttemptFenced,
    AttemptReleased,
    Decided,
    DeltasDelivered,
    FirstDeltaCommitted,
    StreamResumed,
)

BASE = datetime(2025, 6, 1, 10, 0, tzinfo=UTC)  # in the past, for the "quiet for a minute" query
HOUR = timedelta(hours=1)
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"  # the OpenTelemetry trace req_fence was accepted in


def at(minutes: float) -> datetime:
    return BASE + timedelta(minutes=minutes)


LOG = {
    trace.request_id: trace
    for trace in (
        traces.completed("req_ok_1", "w1", at=at(0)),
        traces.completed("req_ok_2", "w2", at=at(5), ttft_ms=40, metadata={"team": "search", "run": "7"}),
        traces.completed("req_ok_3", "w1", at=at(10), model="big-llm", tenant="globex", ttft_ms=100),
        traces.retried_before_first_delta("req_retry", at=at(20)),
        traces.fenced_then_retried("req_fence", at=at(30), trace_id=TRACE_ID),
        traces.interrupted_in_decode("req_cut_1", "w1", at=at(40)),
        traces.interrupted_in_decode("req_cut_2", "w1", at=at(75)),
        traces.interrupted_in_decode("req_cut_3", "w2", at=at(80)),
        traces.stalled_in_decode("req_stall", "w3", at=at(90)),
        traces.cancelled_by_client("req_gone", at=at(100)),
        traces.with_tool_call("req_tool", at=at(110)),
        traces.in_flight("req_live", at=at(120)),
        traces.resumed_within_grace("req_back", at=at(130)),
        traces.left_for_good("req_left", at=at(140)),
        traces.pooled("req_embed_1", "/v1/embeddings", at=at(150), prompt_tokens=4),
        traces.pooled("req_embed_2", "/v1/embeddings", at=at(151), prompt_tokens=7, retried=True),
        traces.pooled("req_rerank", "/rerank", at=at(152), prompt_tokens=11),
    )
}
PARAMETERS = {
    "request_id": "req_cut_1",
    "since": BASE,
    "last_hour": at(60),
    "trace_id": TRACE_ID,
    "team": "search",
    "model": "m",
    "at": datetime.now(UTC) + timedelta(days=1),  # the fleet's events are written on PostgreSQL's clock
}


ADMIN: dict[str, Any] = {"source": "admin", "actor": "admin", "instance_id": None}


def first(trace: traces.Trace, kind: type) -> Any:  # the first event of that type
    return next(event for event in trace.events if isinstance(event, kind))


def fence_ms(trace: traces.Trace) -> float:
    elapsed = first(trace, AttemptReleased).occurred_at - first(trace, AttemptFenced).occurred_at
    return round(float(elapsed / timedelta(milliseconds=1)), 1)


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    rank = fraction * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def ttft_ms(trace: traces.Trace) -> float:
    elapsed = first(trace, FirstDeltaCommitted).occurred_at - trace.events[0].occurred_at
    return float(elapsed / timedelta(milliseconds=1))


def rows(result: list[asyncpg.Record]) -> list[tuple[Any, ...]]:
    return [tuple(record.values()) for record in result]


def expect_retried(result: list[asyncpg.Record]) -> None:
    assert rows(result) == [
        ("req_retry", 2, ["w1", "w2"], "completed", at(20)),
        ("req_fence", 2, ["w2", "w3"], "completed", at(30)),
        ("req_embed_2", 2, ["w4", "w5"], "completed", at(151)),
    ]


def expect_interrupted(result: list[asyncpg.Record]) -> None:
    assert rows(result) == [
        ("w1", BASE, 1, 3),
        ("w1", BASE + HOUR, 1, 3),
        ("w2", BASE + HOUR, 1, 3),
        ("w3", BASE + HOUR, 1, 1),
    ]


def expect_deliveries(result: list[asyncpg.Record]) -> None:
    deliveries = [event for event in LOG["req_cut_1"].events if isinstance(event, DeltasDelivered)]
    assert rows(result) == [(e.seq, e.occurred_at, 1, e.from_index, e.to_index, e.tokens, e.text) for e in deliveries]
    assert [record["text"] for record in result] == ["The answer", " is"]


def expect_answer(result: list[asyncpg.Record]) -> None:
    assert rows(result) == [("req_cut_1", "The answer is", 3, "failed", "upstream_decode_interrupted")]


def expect_fences(result: list[asyncpg.Record]) -> None:
    fenced, stalled = LOG["req_fence"], LOG["req_stall"]
    assert [(*r[:3], r[4], r[5], float(r[6]), r[7]) for r in rows(result)] == [
        ("req_fence", 1, "w2", "cancel_ack_or_lease_expiry", "lease_expired", fence_ms(fenced), "completed"),
        ("req_stall", 1, "w3", "cancel_ack_or_lease_expiry", "cancel_acked", fence_ms(stalled), "failed"),
    ]
    assert [r["fenced_at"] for r in result] == [first(trace, AttemptFenced).occurred_at for trace in (fenced, stalled)]


def expect_ttft(result: list[asyncpg.Record]) -> None:
    by_model: dict[str, list[float]] = {}
    for trace in LOG.values():
        if trace.state.first_delta_sent:
            by_model.setdefault(trace.state.model, []).append(ttft_ms(trace))
    expected = [
        (model, len(values), *(round(percentile(values, q), 1) for q in (0.5, 0.9, 0.99)))
        for model, values in sorted(by_model.items())
    ]
    assert [(r[0], r[1], *(float(value) for value in r[2:])) for r in rows(result)] == [
        (model, count, *(pytest.approx(value, abs=0.051) for value in values)) for model, count, *values in expected
    ]


def expect_nothing(result: list[asyncpg.Record]) -> None:
    assert rows(result) == []


def expect_failures(result: list[asyncpg.Record]) -> None:
    assert rows(result) == [
        ("w1", "replica_exited", 3, 0),
        ("w2", "liveness_uncertain", 1, 1),
        ("w2", "replica_exited", 1, 0),
        ("w3", "liveness_uncertain", 1, 1),
        ("w4", "replica_exited", 1, 0),
    ]


def expect_outcomes(result: list[asyncpg.Record]) -> None:
    assert [(*r[:7], float(r[7])) for r in rows(result)] == [
        ("acme", BASE, 5, 4, 1, 0, 0, 20.0),
        ("acme", BASE + HOUR, 5, 1, 3, 1, 0, 60.0),
        ("acme", BASE + 2 * HOUR, 6, 4, 0, 1, 1, 0.0),
        ("globex", BASE, 1, 1, 0, 0, 0, 0.0),
    ]


def expect_quiet(result: list[asyncpg.Record]) -> None:
    live = LOG["req_live"]
    assert [r[:7] for r in rows(result)] == [
        ("req_live", "gw-1", "decode", 1, ["w1"], at(120), live.events[-1].occurred_at)
    ]


def expect_tool_calls(result: list[asyncpg.Record]) -> None:
    assert [(*r[:6], json.loads(r[6])) for r in rows(result)] == [
        ("req_tool", 1, "call_1", "get_weather", 1, "succeeded", {"celsius": 21})
    ]


def expect_decisions(result: list[asyncpg.Record]) -> None:
    counted = Counter(
        (event.action, event.reason, event.policy_version)
        for trace in LOG.values()
        for event in trace.events
        if isinstance(event, Decided)
    )
    assert {(r[0], r[1], r[2]): r[3] for r in rows(result)} == counted
    assert [r[3] for r in rows(result)] == sorted((r[3] for r in rows(result)), reverse=True)


def expect_timeline(result: list[asyncpg.Record]) -> None:
    trace = LOG["req_cut_1"]
    start = trace.events[0].occurred_at
    assert [(r["seq"], r["type"], r["attempt"]) for r in result] == [
        (e.seq, type(e).__name__, getattr(e, "attempt", None)) for e in trace.events
    ]
    assert [float(r["at_ms"]) for r in result] == [
        pytest.approx((e.occurred_at - start) / timedelta(milliseconds=1), abs=0.051) for e in trace.events
    ]


def expect_instances(result: list[asyncpg.Record]) -> None:
    (died, sweeper) = result
    assert (died["name"], died["live"], died["released"], died["requests_swept"]) == ("gw-dead:8000", False, False, 1)
    assert died["swept_by"] == sweeper["instance_id"] and died["swept_ms_after_lapse"] >= 0
    assert (sweeper["name"], sweeper["live"], sweeper["swept_by"]) == ("gw-live:8000", True, None)


def expect_resumed(result: list[asyncpg.Record]) -> None:
    delivered = LOG["req_retry"].state.delivered_deltas
    assert [r[:4] for r in rows(result)] == [("req_retry", 1, delivered, "gw_live")]


def expect_traced(result: list[asyncpg.Record]) -> None:
    assert rows(result) == [("req_fence", "completed", 2, ["w2", "w3"], at(30))]


def expect_recent_failures(result: list[asyncpg.Record]) -> None:
    # since minute 60: the later cuts, the stall, the clients that left; newest first
    assert [(r["request_id"], r["outcome"], r["error_code"]) for r in result] == [
        ("req_left", "cancelled", "client_gone"),
        ("req_gone", "cancelled", "client_gone"),
        ("req_stall", "failed", "upstream_decode_interrupted"),
        ("req_cut_3", "failed", "upstream_decode_interrupted"),
        ("req_cut_2", "failed", "upstream_decode_interrupted"),
    ]


def expect_clients_that_left(result: list[asyncpg.Record]) -> None:
    assert [(*r[:3], float(r[3]), *r[4:]) for r in rows(result)] == [
        ("req_back", "completed", None, 10.0, 1, 1, False, 3, 4),  # both produced deltas then received
        ("req_gone", "cancelled", "client_gone", 0.0, 1, 0, False, 0, 1),  # no grace: cancelled at once
        ("req_left", "cancelled", "client_gone", 10.0, 1, 0, True, 2, 1),  # produced, never received
    ]


def expect_by_metadata(rows: list[asyncpg.Record]) -> None:
    assert [(r["request_id"], r["tenant"], r["outcome"], json.loads(r["metadata"])) for r in rows] == [
        ("req_ok_2", "acme", "completed", {"team": "search", "run": "7"})
    ]


def expect_serving_at(result: list[asyncpg.Record]) -> None:
    # r2 was cordoned, r4 left: r1 at its revision, r3 serving every model
    assert rows(result) == [("r1", "rev-a", "joined"), ("r3", None, "joined")]


def expect_taken_out(result: list[asyncpg.Record]) -> None:
    assert [(r["event"], r["replica_id"], r["source"], r["actor"], r["reason"]) for r in result] == [
        ("cordoned", "r2", "admin", "admin", "disk errors"),
        ("left", "r4", "admin", "admin", "removed: its attempts ended"),
    ]


def expect_pooling(result: list[asyncpg.Record]) -> None:
    assert [r[:7] for r in rows(result)] == [
        ("/rerank", "tiny-embed", 1, 1, 0, 0, 11),
        ("/v1/embeddings", "tiny-embed", 2, 2, 0, 1, 11),  # one retried: w4 exited, w5 answered
    ]
    assert all(r["median_ms"] > 0 for r in result)


EXPECTATIONS: dict[int, Callable[[list[asyncpg.Record]], None]] = {
    1: expect_retried,
    2: expect_interrupted,
    3: expect_deliveries,
    4: expect_answer,
    5: expect_fences,
    6: expect_ttft,
    7: expect_nothing,
    8: expect_failures,
    9: expect_nothing,
    10: expect_nothing,
    11: expect_outcomes,
    12: expect_quiet,
    13: expect_tool_calls,
    14: expect_decisions,
    15: expect_timeline,
    16: expect_instances,
    17: expect_resumed,
    18: expect_traced,
    19: expect_recent_failures,
    20: expect_clients_that_left,
    21: expect_by_metadata,
    22: expect_serving_at,
    23: expect_taken_out,
    24: expect_pooling,
}


@pytest.fixture
async def audited(event_store: PostgresEventStore, database_url: str) -> AsyncIterator[asyncpg.Connection]:
    """The log above, written as the driver would, and a connection to query it."""
    for number, trace in enumerate(LOG.values()):
        durable = number % 2 == 0
        for seq, event in enumerate(trace.events):
            await event_store.append(trace.request_id, seq, [event], durable=durable)
    await event_store.claim_tool_execution("req_tool:call_1", "req_tool", 1, "call_1", "get_weather", "{}")
    await event_store.record_tool_result("req_tool:call_1", result={"celsius": 21})
    await event_store.flush()
    retried = LOG["req_retry"]  # its stream was resumed from the log after it ended
    resumed = StreamResumed("req_retry", retried.state.seq + 1, at(100), 1, retried.state.delivered_deltas, "gw_live")
    await event_store.append("req_retry", retried.state.seq, [resumed])
    registry = InstanceRegistry(event_store)  # one instance died and was swept by another
    await registry.register(InstanceInfo("gw_dead", "gw-dead:8000", "h1", 11, "0.1.0", None), ttl_s=0.001)
    await registry.register(InstanceInfo("gw_live", "gw-live:8000", "h2", 12, "0.1.0", None), ttl_s=60.0)
    assert await registry.claim_lapsed("gw_live") == ["gw_dead"]
    await registry.swept("gw_dead", "gw_live", closed=1)
    fleet = FleetStore(event_store)  # the fleet: four replicas joined, one cordoned, one left
    for replica_id, models in (
        ("r1", (("m", "rev-a"),)),
        ("r2", (("m", "rev-b"),)),
        ("r3", ()),
        ("r4", (("m", None),)),
    ):
        await fleet.join(DeclaredReplica(replica_id, f"http://{replica_id}:9000", models=models), **ADMIN)
    await fleet.change("r2", "cordoned", **ADMIN, reason="disk errors")
    await fleet.change("r4", "left", **ADMIN, reason="removed: its attempts ended")
    connection = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        yield connection
    finally:
        await connection.close()


def test_every_query_has_an_expectation() -> None:
    assert len(doc_queries()) >= 10
    assert set(doc_queries()) == set(EXPECTATIONS)


@pytest.mark.parametrize("number", sorted(EXPECTATIONS), ids=lambda n: f"{n}. {doc_queries()[n][0]}")
async def test_the_documented_query_returns_what_it_should(audited: asyncpg.Connection, number: int) -> None:
    sql, parameters = bind(doc_queries()[number][1], PARAMETERS)
    EXPECTATIONS[number](await audited.fetch(sql, *parameters))


async def test_the_disagreement_query_finds_a_drifted_read_model(audited: asyncpg.Connection) -> None:
    await audited.execute("UPDATE requests SET delivered_output_tokens = 0 WHERE request_id = 'req_cut_2'")
    sql, parameters = bind(doc_queries()[7][1], PARAMETERS)
    assert [record["request_id"] for record in await audited.fetch(sql, *parameters)] == ["req_cut_2"]


@pytest.mark.parametrize("number", sorted(bounded_queries()), ids=lambda n: f"{n}. bounded")
async def test_a_bounded_form_returns_what_its_query_returns_over_the_whole_log(
    audited: asyncpg.Connection, number: int
) -> None:
    # with the window opening before the log's first request, nothing is left out
    bounded, indexes = bounded_queries()[number]
    for statement in indexes:
        await audited.execute(statement)
    whole = await audited.fetch(*_bound(doc_queries()[number][1]))
    windowed = await audited.fetch(*_bound(bounded))
    assert sorted(map(tuple, windowed)) == sorted(map(tuple, whole))
    if number not in (7, 9, 10):  # the should-be-none checks return nothing here either way
        assert whole, "a bounded form checked against an empty answer proves nothing"
    for statement in indexes:
        await audited.execute(f"DROP INDEX {index_name(statement)}")


def _bound(sql: str) -> list[Any]:
    text, values = bind(sql, PARAMETERS)
    return [text, *values]
