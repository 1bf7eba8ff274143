"""Deliveries reach the log while the stream runs (DESIGN.md §11), never ahead of the client.

A slow sim worker streams one token every 60 ms; while the client reads, the log is
read through the gateway's store. Each time, what the log says was delivered must be
no more than the client has, and no more than two delivery batches behind it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from statemachine import events as ev
from tests.support.gateway import MODEL, running_gateway
from tests.support.transcript import of
from tests.support.workers import WorkerProcess, running_worker

BATCH = 4  # deltas per DeltasDelivered at most
BATCH_MS = 100.0  # and no older than this


@pytest.fixture(scope="module")
def slow_worker() -> Iterator[WorkerProcess]:
    with running_worker(args=["--sim-decode-ms-per-token", "60"]) as worker:
        yield worker


def logged_deltas(events: list[ev.Event]) -> int:
    return sum(e.to_index - e.from_index for e in of(events, ev.DeltasDelivered))  # type: ignore[attr-defined]


def test_the_log_follows_a_live_stream_within_two_batches(database_url: str, slow_worker: WorkerProcess) -> None:
    with running_gateway(
        database_url, [slow_worker], delivery_batch_tokens=BATCH, delivery_batch_ms=BATCH_MS
    ) as gateway:
        stream = gateway.openai().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "a slow one"}], stream=True, max_tokens=40
        )
        request_id = stream.response.headers["x-request-id"]
        received = 0
        seen_in_the_log: list[tuple[int, int]] = []  # (client, log) while the stream ran
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                received += 1
                if received % 5 == 0:
                    logged = logged_deltas(gateway.call(gateway.gateway.ctx.store.read(request_id)))
                    seen_in_the_log.append((received, logged))
                    assert logged <= received, "the log is ahead of what the client received"
                    assert received - logged <= 2 * BATCH + 1, f"the log lags: {received} sent, {logged} logged"
        assert received >= 20
        # a pause longer than the batch age: the open batch is recorded by its timer
        time.sleep(BATCH_MS / 1000 + 0.3)
        gateway.settle()
        assert logged_deltas(gateway.events(request_id)) == received
        assert any(logged > 0 for client, logged in seen_in_the_log[:-1]), "nothing reached the log mid-stream"
