"""vLLM's beam search in the worker (app/worker/vllm_beams.py), on the run's shared vLLM
worker: a search is one engine request a beam and a step, under ids vLLM draws itself (each
beginning with the attempt's engine request id). A cancel is acknowledged only once none of
them runs, so a worker replica's acknowledged cancel holds for it too (docs/design.md §7). Its
answers against ``vllm serve``: tests/compat (*use_beam_search, length_penalty*)."""

from __future__ import annotations

import asyncio
import time

import pytest

from app.replicas.worker_client import WorkerClient
from tests.support.streams import collect, worker_view
from tests.support.vllm_replicas import MODEL, SharedVllm
from tests.support.workers import request_id

pytestmark = pytest.mark.vllm

CONNECT_S = 30.0


async def test_a_beam_search_cancelled_midway_is_acknowledged_once_none_of_its_engine_requests_runs(
    vllm: SharedVllm,
) -> None:
    worker = vllm.worker()
    # A search keeps the CPU engine's threads busy on every core: the test's own connect
    # to the worker once took longer than the gateway's 2 s in CI. What is judged here is
    # the cancel's acknowledgement, so this client waits longer for a connection.
    client = WorkerClient(worker.base_url, connect_timeout=CONNECT_S)
    rid = request_id("beam")
    asked = {"max_tokens": 3000, "n": 2}  # long: 300 steps were over within 2 s on CI
    # the shared worker has two slots: an earlier test's attempt still in one would queue
    # this search past the wait below (its stream unread, its lease not yet lapsed)
    deadline = time.monotonic() + 120
    while busy := [a for a in (await worker_view(worker.base_url))["attempts"] if not a["engine_over"]]:
        assert time.monotonic() < deadline, f"the shared worker is still busy: {busy}"
        await asyncio.sleep(0.1)
    try:
        stream = await client.start(
            request_id=rid,
            attempt=1,
            lease_epoch=1,
            lease_ttl_s=120,  # the cancel, not the lease, ends it
            model=MODEL,
            messages=[{"role": "user", "content": "tell me a long story"}],
            params=asked,
            vllm={**asked, "use_beam_search": True, "ignore_eos": True},
        )
        prefix = f"{rid}/1#"  # the attempt's engine request id, as the worker names it
        deadline = time.monotonic() + 60
        steps_seen: set[str] = set()
        while len(steps_seen) < 2:  # the search is under way: steps' engine requests came and went
            seen = await worker_view(worker.base_url)
            steps_seen |= {r for r in seen["engine_requests"] if r.startswith(prefix)}
            (mine,) = [a for a in seen["attempts"] if a["request_id"] == rid]
            assert not mine["engine_over"], f"the search ended before the cancel: {mine}"
            assert time.monotonic() < deadline, f"not two steps of the search in 60 s: {steps_seen} {seen}"
            await asyncio.sleep(0.01)
        ack = await client.cancel(rid, 1, 1, timeout=60)
        after = await worker_view(worker.base_url)  # asked once the acknowledgement came
        assert [r for r in after["engine_requests"] if r.startswith(prefix)] == []
        (mine,) = [a for a in after["attempts"] if a["request_id"] == rid]
        assert ack.state == "aborted" and mine["stop"] == "cancelled" and mine["engine_over"], (ack, mine)
        got = await collect(stream)
        assert not got.tokens and got.error is not None and got.error.code == "cancelled"  # nothing of it went out
    finally:
        await client.aclose()
    # the engine serves the next request: nothing of the search holds it
    short = WorkerClient(worker.base_url, connect_timeout=CONNECT_S)
    try:
        stream = await short.start(
            request_id=request_id("after"),
            attempt=1,
            lease_epoch=1,
            lease_ttl_s=60,
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            params={"max_tokens": 4},
            vllm={"max_tokens": 4},
        )
        assert (await collect(stream)).done is not None
    finally:
        await short.aclose()
