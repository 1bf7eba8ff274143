"""The event store's contract: one test case, run against every implementation.

A backend's test module subclasses :class:`EventStoreContract` and provides the
``store`` fixture (see test_memory_store.py and test_postgres_store.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from datetime import timedelta

import pytest

from app.store import EventStore, InvalidAppend, StoreClosed, StoreError, StreamConflict
from ops import traces
from statemachine.events import DeltasDelivered, Event, RequestCompleted


async def collect(store: EventStore, after: int, count: int, timeout: float = 10.0) -> list[tuple[int, Event]]:
    """The next ``count`` events the store's follower yields after ``after``."""
    seen: list[tuple[int, Event]] = []
    async with asyncio.timeout(timeout), contextlib.aclosing(store.follow(after)) as stream:
        async for item in stream:
            seen.append(item)
            if len(seen) == count:
                break
    return seen


def with_token_ids(events: list[Event]) -> list[Event]:
    """``events`` whose deliveries carry token ids and the prompt's fields (version 3), as
    a request that asked for them (``return_token_ids``) records them, the prompt's token
    count (version 5), as one that asked for the usage in every chunk does, and the prompt's
    log probabilities (version 6), as a whole answer that asked for them does."""
    return [
        dataclasses.replace(
            e,
            token_ids=((7,),) * (e.to_index - e.from_index),
            prompts=((0, (1, 2), "hi"),),
            prompt_tokens=((0, 3),),
            prompt_logprobs=((0, (None, ((2, -1.5, 3, " hi"),))),),
        )
        if isinstance(e, DeltasDelivered)
        else e
        for e in events
    ]


def other_delivery(trace: traces.Trace, seq: int) -> DeltasDelivered:
    """A delivery that differs from whatever the trace holds at ``seq``."""
    return DeltasDelivered(trace.request_id, seq, traces.T0, 1, 1, 0, 1, 1, "someone else's text", None)


class EventStoreContract:
    @pytest.fixture
    def store(self) -> AsyncIterator[EventStore]:
        raise NotImplementedError("a backend's test case provides the store")

    # --- appending and reading -----------------------------------------------------------

    async def test_appended_events_read_back_equal(self, store: EventStore) -> None:
        trace = traces.fenced_then_retried("req_a")
        assert await store.append("req_a", 0, trace.events[:5]) == 5
        assert await store.append("req_a", 5, trace.events[5:]) == len(trace.events)
        assert await store.read("req_a") == trace.events

    async def test_an_unknown_request_reads_empty(self, store: EventStore) -> None:
        assert await store.read("req_nobody") == []

    async def test_streams_are_kept_apart(self, store: EventStore) -> None:
        first, second = traces.completed("req_1"), traces.interrupted_in_decode("req_2")
        for index in range(max(len(first.events), len(second.events))):
            for trace in (first, second):
                if index < len(trace.events):
                    await store.append(trace.request_id, index, [trace.events[index]])
        assert await store.read("req_1") == first.events
        assert await store.read("req_2") == second.events

    async def test_appending_the_same_events_again_is_a_noop(self, store: EventStore) -> None:
        trace = traces.completed("req_retry")
        await store.append("req_retry", 0, trace.events[:4])
        await store.append("req_retry", 0, trace.events[:4])  # a retry after an unknown outcome
        await store.append("req_retry", 2, trace.events[2:6])  # overlaps: 3 and 4 exist, 5 and 6 are new
        assert await store.read("req_retry") == trace.events[:6]

    async def test_a_different_event_at_a_taken_version_conflicts(self, store: EventStore) -> None:
        trace = traces.completed("req_taken")
        await store.append("req_taken", 0, trace.events[:5])
        with pytest.raises(StreamConflict) as raised:
            await store.append("req_taken", 4, [other_delivery(trace, 5)])
        assert raised.value.request_id == "req_taken"
        assert raised.value.expected_version == 4
        assert await store.read("req_taken") == trace.events[:5]

    async def test_an_expected_version_past_the_end_conflicts(self, store: EventStore) -> None:
        trace = traces.completed("req_gap")
        await store.append("req_gap", 0, trace.events[:3])
        with pytest.raises(StreamConflict):
            await store.append("req_gap", 4, trace.events[4:6])
        with pytest.raises(StreamConflict):
            await store.append("req_new", 1, [traces.completed("req_new").events[1]])
        assert await store.read("req_gap") == trace.events[:3]
        assert await store.read("req_new") == []

    @pytest.mark.parametrize(
        ("request_id", "expected_version", "first", "count"),
        [
            ("req_other", 0, 0, 1),
            ("req_bad", 1, 0, 2),
            ("req_bad", 0, 1, 1),
            ("req_bad", -1, 0, 1),
            ("req_bad", 0, 0, 0),
        ],
        ids=["wrong request", "seq behind", "seq ahead", "negative version", "no events"],
    )
    async def test_events_that_do_not_fit_the_append_are_refused(
        self, store: EventStore, request_id: str, expected_version: int, first: int, count: int
    ) -> None:
        trace = traces.completed("req_bad")
        with pytest.raises(InvalidAppend):
            await store.append(request_id, expected_version, trace.events[first : first + count])
        assert issubclass(InvalidAppend, ValueError)

    async def test_a_stream_begins_with_request_accepted_and_only_there(self, store: EventStore) -> None:
        accepted, decided = traces.completed("req_first").events[:2]
        with pytest.raises(InvalidAppend, match="begins with RequestAccepted"):
            await store.append("req_first", 0, [dataclasses.replace(decided, seq=1)])
        await store.append("req_first", 0, [accepted])
        with pytest.raises(InvalidAppend, match="begins with RequestAccepted"):
            await store.append("req_first", 1, [dataclasses.replace(accepted, seq=2)])

    async def test_two_writers_racing_for_one_version_one_wins(self, store: EventStore) -> None:
        trace = traces.completed("req_race")
        await store.append("req_race", 0, trace.events[:5])
        ours, theirs = trace.events[5], other_delivery(trace, 6)
        results = await asyncio.gather(
            store.append("req_race", 5, [ours]), store.append("req_race", 5, [theirs]), return_exceptions=True
        )
        assert sorted(type(result).__name__ for result in results) == ["StreamConflict", "int"]
        winner = ours if results[0] == 6 else theirs
        assert await store.read("req_race") == [*trace.events[:5], winner]

    # --- durable and non-durable appends -------------------------------------------------

    async def test_deliveries_then_a_durable_terminal_event_land_in_order(self, store: EventStore) -> None:
        trace = traces.completed("req_mixed", texts=tuple(f"t{n}" for n in range(20)))
        events = trace.events
        terminal = len(events) - 1
        await store.append("req_mixed", 0, events[:5])  # up to the commit point, durable
        for seq in range(5, terminal):
            await store.append("req_mixed", seq, [events[seq]], durable=False)
        await store.append("req_mixed", terminal, [events[terminal]])  # the terminal event, durable
        assert isinstance(events[terminal], RequestCompleted)
        assert await store.read("req_mixed") == events  # no flush needed: the durable one waited

    async def test_flush_commits_what_was_queued(self, store: EventStore) -> None:
        trace = traces.completed("req_flush")
        for seq, event in enumerate(trace.events):
            await store.append("req_flush", seq, [event], durable=False)
        await store.flush()
        assert await store.read("req_flush") == trace.events

    async def test_a_queued_appends_conflict_is_raised_by_the_next_append(self, store: EventStore) -> None:
        trace = traces.completed("req_late")
        await store.append("req_late", 0, trace.events[:5])
        await store.append("req_late", 5, [other_delivery(trace, 6)])  # another writer got there first
        await store.append("req_late", 5, [trace.events[5]], durable=False)  # accepted, fails later
        await store.flush()
        with pytest.raises(StreamConflict):
            await store.append("req_late", 6, [trace.events[6]])
        # once told, the writer may read the stream again and carry on from there
        assert len(await store.read("req_late")) == 6
        completed = RequestCompleted("req_late", 7, traces.T0, "stop", {})
        assert await store.append("req_late", 6, [completed]) == 7

    async def test_a_grouped_append_settles_when_committed(self, store: EventStore) -> None:
        trace = traces.completed("req_grouped")
        await store.append("req_grouped", 0, trace.events[:5])
        committed = await store.append_grouped("req_grouped", 5, trace.events[5:7])
        await committed  # settles without a flush: the group commit takes it
        assert await store.read("req_grouped") == trace.events[:7]

    async def test_a_grouped_appends_conflict_is_raised_when_awaited(self, store: EventStore) -> None:
        trace = traces.completed("req_grouped_late")
        await store.append("req_grouped_late", 0, trace.events[:5])
        await store.append("req_grouped_late", 5, [other_delivery(trace, 6)])  # another writer got there first
        committed = await store.append_grouped("req_grouped_late", 5, [trace.events[5]])
        with pytest.raises(StreamConflict):
            await committed
        assert len(await store.read("req_grouped_late")) == 6

    # --- following the log ---------------------------------------------------------------

    async def test_a_follower_sees_every_event_once_in_stream_order(self, store: EventStore) -> None:
        scenario = [
            traces.completed("req_f1"),
            traces.retried_before_first_delta("req_f2"),
            traces.in_flight("f3"),
        ]
        for index in range(20):
            for trace in scenario:
                if index < len(trace.events):
                    await store.append(trace.request_id, index, [trace.events[index]], durable=index % 3 == 0)
        total = sum(len(trace.events) for trace in scenario)
        await store.flush()
        seen = await collect(store, 0, total)
        positions = [position for position, _ in seen]
        assert positions == sorted(set(positions))
        for trace in scenario:
            assert [event for _, event in seen if event.request_id == trace.request_id] == trace.events

    async def test_a_follower_waits_for_new_events_and_resumes_after_a_position(self, store: EventStore) -> None:
        trace = traces.completed("req_wait")
        await store.append("req_wait", 0, trace.events[:3])
        first = await collect(store, 0, 3)
        waiting = asyncio.create_task(collect(store, first[-1][0], 2))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await store.append("req_wait", 3, trace.events[3:5])
        assert [event for _, event in await waiting] == trace.events[3:5]
        resumed = await collect(store, first[1][0], 3)
        assert [event for _, event in resumed] == trace.events[2:5]

    async def test_following_from_a_position_not_in_the_log_is_refused(self, store: EventStore) -> None:
        with pytest.raises(ValueError, match="not in the log"):
            await collect(store, 10**12, 1)

    async def test_unfinished_requests_are_found_per_gateway(self, store: EventStore) -> None:
        later = traces.T0 + timedelta(seconds=1)
        for trace in (
            traces.in_flight("req_b2", at=later, gateway="gw-b"),
            traces.in_flight("req_a1", gateway="gw-a"),
            traces.in_flight("req_b1", gateway="gw-b"),
            traces.completed("req_done"),
        ):
            await store.append(trace.request_id, 0, trace.events)
        assert await store.unfinished_requests(gateway="gw-b") == ["req_b1", "req_b2"]
        assert sorted(await store.unfinished_requests()) == ["req_a1", "req_b1", "req_b2"]
        assert await store.unfinished_requests(gateway="gw-z") == []

    # --- the tool ledger and recorded inputs ---------------------------------------------

    async def test_a_tool_execution_is_claimed_once(self, store: EventStore) -> None:
        claims = [
            await store.claim_tool_execution("req_t:call_1", "req_t", attempt, "call_1", "get_weather", "{}")
            for attempt in (1, 2, 2)
        ]
        assert claims == [True, False, False]
        claimed = await store.tool_execution("req_t:call_1")
        assert claimed is not None
        assert (claimed.attempt, claimed.status, claimed.finished_at) == (1, "claimed", None)
        assert await store.tool_execution("req_t:call_2") is None

    async def test_a_tool_result_is_recorded_once(self, store: EventStore) -> None:
        await store.claim_tool_execution("req_t:call_1", "req_t", 1, "call_1", "get_weather", '{"city": "Oslo"}')
        await store.record_tool_result("req_t:call_1", result={"celsius": -3})
        await store.record_tool_result("req_t:call_1", error="a second outcome is ignored")
        done = await store.tool_execution("req_t:call_1")
        assert done is not None
        assert (done.status, done.result, done.error) == ("succeeded", {"celsius": -3}, None)
        assert done.finished_at is not None
        with pytest.raises(StoreError, match="never claimed"):
            await store.record_tool_result("req_t:call_9", result=1)

    async def test_a_request_input_is_kept_once(self, store: EventStore) -> None:
        body = {"model": "tiny-llm", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        await store.record_input("req_in", body, model_revision="r2026.11", seed=7)
        await store.record_input("req_in", {"model": "another"})
        kept = await store.read_input("req_in")
        assert kept is not None
        assert (kept.body, kept.model_revision, kept.seed) == (body, "r2026.11", 7)
        assert await store.read_input("req_none") is None

    async def test_any_json_body_is_kept_as_it_was(self, store: EventStore) -> None:
        nul = {"model": "tiny-llm", "messages": [{"role": "user", "content": "a\x00b \N{GRINNING FACE}"}]}
        plain = {"model": "tiny-llm", "messages": [{"role": "user", "content": "recorded with it"}]}
        await asyncio.gather(store.record_input("req_nul", nul), store.record_input("req_plain", plain))
        for request_id, body in (("req_nul", nul), ("req_plain", plain)):
            kept = await store.read_input(request_id)
            assert kept is not None and kept.body == body

    async def test_one_requests_content_is_erased_for_its_tenant_only(self, store: EventStore) -> None:
        for request_id in ("req_erase", "req_keep"):
            trace = traces.completed(request_id)
            await store.append(request_id, 0, with_token_ids(trace.events), durable=True)
            await store.record_input(request_id, {"model": "tiny-llm", "input": "secret"})
        await store.flush()
        assert await store.erase_request("another-tenant", "req_erase") == 0
        assert await store.read_input("req_erase") is not None
        assert await store.erase_request("acme", "req_erase") == 1
        erased, kept = await store.read("req_erase"), await store.read("req_keep")
        assert [type(e) for e in erased] == [type(e) for e in kept]  # the skeleton, whole
        delivered = [e for e in erased if isinstance(e, DeltasDelivered)]
        assert delivered and all(e.text is None and e.text_sha256 is None for e in delivered)
        assert all(not e.token_ids and not e.prompts and e.logprobs is None for e in delivered)  # content too
        assert all(not e.prompt_logprobs for e in delivered)  # the decoded prompt: content
        assert all(e.prompt_tokens == ((0, 3),) for e in delivered)  # a count, not content: kept
        assert all(e.text and e.prompts and e.prompt_logprobs for e in kept if isinstance(e, DeltasDelivered))
        assert await store.read_input("req_erase") is None and await store.read_input("req_keep") is not None

    # --- closing -------------------------------------------------------------------------

    async def test_a_closed_store_accepts_nothing(self, store: EventStore) -> None:
        trace = traces.completed("req_closed")
        await store.append("req_closed", 0, trace.events[:2], durable=False)
        await store.close()
        await store.close()  # idempotent
        with pytest.raises(StoreClosed):
            await store.append("req_closed", 2, trace.events[2:3])
        with pytest.raises(StoreClosed):
            await store.read("req_closed")
        with pytest.raises(StoreClosed):
            await store.ping()
        assert not store.accepting

    async def test_an_open_store_answers_a_ping(self, store: EventStore) -> None:
        await store.ping()
        assert store.accepting
