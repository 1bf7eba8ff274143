"""Deliveries reach the log while the stream runs (docs/design.md §11), never ahead of the client.

A sim worker streams 20 tokens and then stalls: the stream is provably still open,
with nothing more to send, while the test reads the log through the gateway's store.
The log must come to hold exactly the 20 deltas the client has (the last, part-full
batch recorded by its age timer, not by the stream's end), in batches of at most
``BATCH`` deltas. Reading the log at a wall-clock moment of a running stream cannot
judge "not ahead": a delta written to the socket is logged before the client's
iterator has parsed it. The stall makes both counts final, so they can be compared.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from app.config import Timeouts
from statemachine import events as ev
from tests.app.conftest import add_fault
from tests.support.gateway import MODEL, running_gateway
from tests.support.transcript import of
from tests.support.workers import WorkerProcess, running_worker

BATCH = 4  # deltas per DeltasDelivered at most
BATCH_MS = 100.0  # and no older than this
SENT = 22  # deltas before the stall: five full batches and a part-full one
# the stall is the test's, not a fault for the gateway to find: its stall timer far away
PATIENT = Timeouts(stall_s=120.0)


@pytest.fixture(scope="module")
def stalling_worker() -> Iterator[WorkerProcess]:
    with running_worker(faults=True, args=["--sim-decode-ms-per-token", "20"]) as worker:
        yield worker


def logged_deltas(events: list[ev.Event]) -> int:
    return sum(e.to_index - e.from_index for e in of(events, ev.DeltasDelivered))  # type: ignore[attr-defined]


def test_the_log_holds_a_live_streams_deltas_before_it_ends(database_url: str, stalling_worker: WorkerProcess) -> None:
    add_fault(stalling_worker, action="stall", at_token=SENT, match={"prompt_contains": "stalls after a while"})
    with running_gateway(
        database_url,
        [stalling_worker],
        delivery_batch_tokens=BATCH,
        delivery_batch_ms=BATCH_MS,
        timeouts=PATIENT,
        resume_grace_s=0,
    ) as gateway:
        stream = gateway.openai().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "stalls after a while"}], stream=True, max_tokens=40
        )
        request_id = stream.response.headers["x-request-id"]
        received = 0
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                received += 1
                if received == SENT:
                    break  # the worker sends nothing more: the stream is open and idle
        assert received == SENT

        def logged() -> int:
            return logged_deltas(gateway.call(gateway.gateway.ctx.store.read(request_id)))

        deadline = time.monotonic() + 30.0
        while logged() < SENT and time.monotonic() < deadline:
            time.sleep(0.05)
        events = gateway.call(gateway.gateway.ctx.store.read(request_id))
        assert logged_deltas(events) == SENT, "the log does not hold what the client has while the stream runs"
        ended = (ev.RequestCompleted, ev.RequestFailed, ev.RequestCancelled)
        assert not [e for e in events if isinstance(e, ended)], "the request ended before the test let it"
        batches = of(events, ev.DeltasDelivered)
        assert [b.from_index for b in batches[1:]] == [b.to_index for b in batches[:-1]]  # type: ignore[attr-defined]
        assert all(0 < b.to_index - b.from_index <= BATCH for b in batches)  # type: ignore[attr-defined]
        stream.close()
        gateway.settle()
        assert logged_deltas(gateway.events(request_id)) == SENT, "the end of the stream changed what was delivered"
