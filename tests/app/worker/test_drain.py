"""SIGTERM: stop accepting, let running attempts finish within the grace, end the rest, exit."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator

import pytest

from app.replicas.base import Token
from app.replicas.worker_errors import ReplicaExiting
from statemachine.events import FailureKind
from tests.app.worker.engines import EngineUnderTest, start_sim_engine, vllm_engine
from tests.support.streams import add_fault, collect
from tests.support.vllm_replicas import DRAIN_GRACE_S, group_alive
from tests.support.workers import request_id

GRACE_S = DRAIN_GRACE_S  # the shared vLLM worker's; the sim worker is given the same
# The drain ends what is left once the grace is over, not when the held attempt (a minute
# of prefill) would: past the grace, only a real fault takes this long.
ENDED_WITHIN_S = GRACE_S + 20.0


VLLM_DRAINED = pytest.param("vllm", id="vllm", marks=[pytest.mark.vllm, pytest.mark.ends_vllm_worker])


@pytest.fixture(params=[pytest.param("sim", id="sim"), VLLM_DRAINED])
def drained(request: pytest.FixtureRequest) -> Iterator[EngineUnderTest]:
    """A worker the test drains: a sim worker of its own, or the run's vLLM worker (the next
    test that needs one gets a new one)."""
    if request.param == "vllm":
        yield vllm_engine(request.getfixturevalue("vllm"))
        return
    under_test = start_sim_engine(["--grace-s", str(GRACE_S), "--max-running", "4"])
    try:
        yield under_test
    finally:
        under_test.worker.kill()


async def test_sigterm_finishes_what_fits_in_the_grace_and_ends_the_rest(drained: EngineUnderTest) -> None:
    under_test = drained
    engine_name = under_test.engine
    worker, client, model = under_test.worker, under_test.worker.client(), under_test.model
    try:
        short_id, held_id, long_id = request_id("short"), request_id("held"), request_id("long")
        # an attempt that cannot finish within the grace, whatever the engine's speed
        await add_fault(worker.base_url, action="slow_prefill", prefill_ms=60_000, match={"request_id": held_id})
        held = await client.start(request_id=held_id, attempt=1, lease_epoch=1, lease_ttl_s=30, model=model, prompt="x")
        short = await client.start(
            request_id=short_id,
            attempt=1,
            lease_epoch=1,
            lease_ttl_s=30,
            model=model,
            prompt="short",
            params=under_test.short(40),
        )
        long = None
        if engine_name == "sim":
            # Caught mid-decode. Not on vLLM here: while vLLM decodes on this two-core
            # machine, other processes (this worker's own loop included) can stall for
            # seconds, so no grace period would be safe to assert on.
            long = await client.start(
                request_id=long_id,
                attempt=1,
                lease_epoch=1,
                lease_ttl_s=30,
                model=model,
                prompt="long",
                params=under_test.long(),
            )
            assert isinstance((await collect(long, tokens=1)).frames[-1], Token)  # decoding
        await asyncio.sleep(0.05)
        worker.signal(signal.SIGTERM)
        t_term = time.monotonic()
        await asyncio.sleep(0.2)

        with pytest.raises(ReplicaExiting) as exiting:
            await client.start(
                request_id=request_id(), attempt=1, lease_epoch=1, lease_ttl_s=30, model=model, prompt="x"
            )
        assert (exiting.value.status, exiting.value.code) == (503, "replica_exiting")
        assert exiting.value.kind is FailureKind.REPLICA_EXITED
        assert not await client.ready()
        assert (await client.health()).code == "replica_exiting"
        await client.renew(held_id, 1, 1, 30)  # leases are still kept during the drain

        finished = await collect(short)
        assert finished.done is not None and finished.error is None
        for stream in (held, long) if long is not None else (held,):
            ended = await collect(stream)
            assert isinstance(ended.error, ReplicaExiting) and ended.error.code == "replica_exiting"
        assert GRACE_S - 0.1 < time.monotonic() - t_term < ENDED_WITHIN_S

        exit_code = await asyncio.to_thread(worker.wait, 60)
        assert exit_code == 0, worker.logs()[-3000:]
        deadline = time.monotonic() + 20
        while group_alive(worker.pid) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert not group_alive(worker.pid), "the engine's processes outlived the worker"
    finally:
        await client.aclose()
