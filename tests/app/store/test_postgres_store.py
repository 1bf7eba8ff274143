"""The PostgreSQL event store: the contract, then what only PostgreSQL can show."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from app.store import EventStore, PostgresEventStore
from ops import traces
from statemachine.events import DeltasDelivered, RequestCompleted
from tests.app.store.contract import EventStoreContract


class TestPostgresEventStore(EventStoreContract):
    @pytest.fixture
    async def store(self, event_store: PostgresEventStore) -> AsyncIterator[EventStore]:
        yield event_store


async def test_text_holding_u0000_is_recorded_and_the_stream_goes_on(event_store: PostgresEventStore) -> None:
    trace = traces.completed("req_nul", texts=("a\x00b", "c"))  # a byte-level tokenizer's byte 0
    for seq, event in enumerate(trace.events):
        await event_store.append("req_nul", seq, [event], durable=False)
    await event_store.flush()
    recorded = await event_store.read("req_nul")
    assert len(recorded) == len(trace.events) and isinstance(recorded[-1], RequestCompleted)
    texts = [event.text for event in recorded if isinstance(event, DeltasDelivered)]
    assert texts == ["a\N{REPLACEMENT CHARACTER}b", "c"]


async def test_tool_calls_and_results_holding_u0000_are_kept(event_store: PostgresEventStore) -> None:
    assert await event_store.claim_tool_execution("req_t:call_1", "req_t", 1, "call_1", "f\x00", '{"a": "\x00"}')
    await event_store.record_tool_result("req_t:call_1", result={"out": "x\x00y"})
    kept = await event_store.tool_execution("req_t:call_1")
    assert kept is not None and kept.status == "succeeded"
    assert (kept.name, kept.arguments) == ("f\N{REPLACEMENT CHARACTER}", '{"a": "\N{REPLACEMENT CHARACTER}"}')
    assert kept.result == {"out": "x\N{REPLACEMENT CHARACTER}y"}
