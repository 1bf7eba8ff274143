"""The read models, kept by the trigger in the append's transaction, agree with fold."""

from __future__ import annotations

import asyncio
import random
import threading
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import event, text
from sqlalchemy.ext.asyncio import AsyncConnection

from app.store import PostgresEventStore
from app.store.audit import fold_disagreements
from ops import traces
from statemachine.events import FirstDeltaCommitted
from statemachine.trace import parse_trace

SCENARIOS = [
    traces.completed,
    traces.retried_before_first_delta,
    traces.fenced_then_retried,
    traces.interrupted_in_decode,
    traces.stalled_in_decode,
    traces.cancelled_by_client,
    traces.with_tool_call,
    traces.in_flight,
]


async def append_all(store: PostgresEventStore, trace: traces.Trace, batching: str) -> None:
    if batching == "one append":
        await store.append(trace.request_id, 0, trace.events)
    elif batching == "event by event":
        for seq, event in enumerate(trace.events):
            await store.append(trace.request_id, seq, [event])
    else:  # queued: every request's events in one group-committed batch
        for seq, event in enumerate(trace.events):
            await store.append(trace.request_id, seq, [event], durable=False)


@pytest.mark.parametrize("batching", ["one append", "event by event", "queued"])
async def test_the_read_models_agree_with_the_fold(
    event_store: PostgresEventStore, db: AsyncConnection, batching: str
) -> None:
    for number, scenario in enumerate(SCENARIOS):
        await append_all(event_store, scenario(f"req_{number}"), batching)
    await event_store.flush()
    assert await fold_disagreements(db) == []
    assert (await db.execute(text("SELECT count(*) FROM requests"))).scalar() == len(SCENARIOS)


async def test_the_check_finds_a_read_model_that_drifted(event_store: PostgresEventStore, db: AsyncConnection) -> None:
    await event_store.append("req_drift", 0, traces.completed("req_drift").events)
    await db.execute(text("UPDATE requests SET delivered_output_tokens = 99, phase = 'decode'"))
    found = {(found.field, found.folded, found.projected) for found in await fold_disagreements(db)}
    assert found == {("delivered_output_tokens", 3, 99), ("phase", "terminated", "decode")}


async def test_a_fenced_retry_as_the_read_models_tell_it(event_store: PostgresEventStore, db: AsyncConnection) -> None:
    trace = traces.fenced_then_retried("req_fenced")
    await event_store.append("req_fenced", 0, trace.events)
    request = (await db.execute(text("SELECT * FROM requests"))).mappings().one()
    state = trace.state
    first_delta_at = next(e.occurred_at for e in trace.events if isinstance(e, FirstDeltaCommitted))
    expected = {
        "phase": "terminated",
        "outcome": "completed",
        "attempts": 2,
        "replicas_tried": ["w2", "w3"],
        "first_delta_attempt": 2,
        "first_delta_sent": True,
        "delivered_output_tokens": 1,
        "first_delta_at": first_delta_at,
        "ttft_ms": pytest.approx((first_delta_at - trace.events[0].occurred_at) / timedelta(milliseconds=1)),
        "last_seq": state.seq,
    }
    assert {column: request[column] for column in expected} == expected
    attempts = (await db.execute(text("SELECT * FROM request_attempts ORDER BY attempt"))).mappings().all()
    fenced, retry = attempts
    assert (fenced["replica_id"], fenced["ended"], fenced["failure_kind"]) == (
        "w2",
        "lease_expired",
        "liveness_uncertain",
    )
    assert fenced["fence_ms"] == pytest.approx(4200 + 0.2 + 0.2)  # lease expiry, then the release
    assert fenced["waiting_for"] == "cancel_ack_or_lease_expiry"
    assert (retry["replica_id"], retry["lease_epoch"], retry["ended"]) == ("w3", 2, "completed")
    assert retry["completed_at"] == trace.events[-1].occurred_at


@pytest.mark.parametrize("seed", range(5))
async def test_the_read_models_agree_whatever_the_batches(
    event_store: PostgresEventStore, db: AsyncConnection, seed: int
) -> None:
    """Appends of random sizes, durable or not, interleaved across requests."""
    shuffle = random.Random(seed)
    pending = {f"req_{n}": scenario(f"req_{n}").events for n, scenario in enumerate(SCENARIOS * 2)}
    written = dict.fromkeys(pending, 0)
    while pending:
        request_id = shuffle.choice(sorted(pending))
        events = pending[request_id]
        size = shuffle.randint(1, 6)
        start = written[request_id]
        await event_store.append(request_id, start, events[start : start + size], durable=shuffle.random() < 0.3)
        written[request_id] = min(start + size, len(events))
        if written[request_id] == len(events):
            del pending[request_id]
    await event_store.flush()
    assert await fold_disagreements(db) == []


TRACES = sorted((Path(__file__).resolve().parents[2] / "traces").glob("*.jsonl"))


@pytest.mark.parametrize("path", TRACES, ids=lambda path: path.stem)
async def test_recorded_traces_round_trip_and_project_as_they_fold(
    event_store: PostgresEventStore, db: AsyncConnection, path: Path
) -> None:
    recorded = parse_trace(path.read_text().splitlines())
    for request_id, events in recorded.requests.items():
        await event_store.append(request_id, 0, events)
        assert await event_store.read(request_id) == events
    assert await fold_disagreements(db) == []


async def test_the_check_reads_the_events_and_the_rows_in_one_snapshot(
    event_store: PostgresEventStore, db: AsyncConnection
) -> None:
    """An append committed between the check's reads of the log and of the rows (a live
    log) is in neither: the check compares one moment, and finds nothing."""
    trace = traces.completed("req_snapshot")
    await event_store.append(trace.request_id, 0, trace.events[:3])

    def append_the_rest() -> None:
        async def append() -> None:
            store = await PostgresEventStore.connect(event_store.url)
            try:
                await store.append(trace.request_id, 3, trace.events[3:])
            finally:
                await store.close()

        asyncio.run(append())  # on a loop of its own: this runs inside the check's statement

    appended = []

    def before_the_rows(conn: object, cursor: object, statement: str, *args: object) -> None:
        if "FROM requests" in statement and not appended:
            worker = threading.Thread(target=append_the_rest)
            worker.start()
            worker.join()
            appended.append(statement)

    event.listen(db.sync_engine, "before_cursor_execute", before_the_rows)
    try:
        assert await fold_disagreements(db) == []
    finally:
        event.remove(db.sync_engine, "before_cursor_execute", before_the_rows)
    assert appended  # the append did come between the reads
    assert await event_store.read(trace.request_id) == trace.events
    assert await fold_disagreements(db) == []  # and the next check, a moment later, sees it all
