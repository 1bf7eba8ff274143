"""Scripted faults on real sim workers, each observed through the client's typed errors."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from typing import Any

import pytest

from app.replicas.attempt_frames import AttemptFrames
from app.replicas.worker_client import WorkerClient, http_client
from app.replicas.worker_errors import (
    ConnectFailed,
    MalformedFrame,
    ReadStalled,
    Rejected,
    ReplicaExiting,
    StreamBroken,
)
from app.worker.sim import tool_call_id
from statemachine.events import FailureKind
from tests.support.streams import add_fault, attempt_state, collect
from tests.support.workers import REPO, WorkerProcess, request_id, running_worker

LONG = {"max_tokens": 2000, "ignore_eos": True}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "lookup", "parameters": {"properties": {"q": {"type": "string"}}}},
    }
]


async def begin(
    client: WorkerClient, rid: str, *, prompt: str = "go on", attempt: int = 1, **kwargs: Any
) -> AttemptFrames:
    kwargs.setdefault("params", LONG)
    return await client.start(
        request_id=rid, attempt=attempt, lease_epoch=1, lease_ttl_s=30, model="sim", prompt=prompt, **kwargs
    )


def _exit_signal(worker: WorkerProcess) -> int:
    return -worker.wait(timeout=10)


@pytest.mark.parametrize(
    ("at_token", "point", "tokens_seen"),
    [(0, "before_frame", 0), (3, "before_frame", 3), (3, "after_frame", 4)],
)
async def test_die_at_token_k_kills_the_process_before_or_after_its_frame(at_token: int, point: str, tokens_seen: int):
    fault = json.dumps({"action": "die", "at_token": at_token, "point": point})
    with running_worker(faults=True, args=["--fault", fault]) as worker:  # the startup flag
        client = worker.client()
        try:
            got = await collect(await begin(client, request_id()))
            assert isinstance(got.error, StreamBroken)
            assert got.error.kind is FailureKind.REPLICA_EXITED and got.error.released
            assert [t.index for t in got.tokens] == list(range(tokens_seen))
            assert _exit_signal(worker) == signal.SIGKILL
            with pytest.raises(ConnectFailed) as refused:
                await begin(client, request_id())
            assert refused.value.kind is FailureKind.REPLICA_EXITED
        finally:
            await client.aclose()


async def test_die_in_prefill():
    with running_worker(faults=True) as worker:
        client = worker.client()
        try:
            await add_fault(worker.base_url, action="die", point="prefill")
            got = await collect(await begin(client, request_id()))
            assert isinstance(got.error, StreamBroken) and not got.tokens and got.heartbeats
            assert _exit_signal(worker) == signal.SIGKILL
        finally:
            await client.aclose()


async def test_a_tool_call_then_death_keeps_the_call_id_of_the_request():
    rid = request_id()
    with running_worker(faults=True) as worker:
        client = worker.client()
        try:
            await add_fault(
                worker.base_url,
                action="tool_call_then_die",
                at_token=1,
                tool_name="lookup",
                tool_arguments='{"q": "x"}',
            )
            got = await collect(await begin(client, rid))  # the fault injects the call after one token
            assert isinstance(got.error, StreamBroken) and len(got.tokens) == 1
            assert [(c.id, c.name) for c in got.tool_calls] == [(tool_call_id(rid, 0, 0), "lookup")]
            assert _exit_signal(worker) == signal.SIGKILL
        finally:
            await client.aclose()
    # a second attempt of the same request, elsewhere, calls the tool under the same id
    with running_worker() as other:
        client = other.client()
        try:
            again = await collect(await begin(client, rid, attempt=2, params={"tools": TOOLS}))
        finally:
            await client.aclose()
    assert [c.id for c in again.tool_calls] == [tool_call_id(rid, 0, 0)]
    assert again.done is not None and again.done.finish_reason == "tool_calls"


async def test_a_stall_publishes_nothing_yet_honours_cancel(sim_worker: WorkerProcess, sim_client: WorkerClient):
    rid = request_id()
    await add_fault(sim_worker.base_url, action="stall", at_token=2, match={"request_id": rid})
    stream = await begin(sim_client, rid)
    assert len((await collect(stream, max_frames=3)).tokens) == 2
    await asyncio.sleep(0.5)  # the stream stays open and silent meanwhile
    stalled = await attempt_state(sim_worker.base_url, rid)
    assert stalled["published_tokens"] == 2
    assert (await sim_client.health()).healthy  # alive, just silent
    ack = await sim_client.cancel(rid, 1, 1)
    assert (ack.state, ack.stop) == ("aborted", "cancelled") and ack.generated_tokens >= stalled["generated_tokens"]
    state = await attempt_state(sim_worker.base_url, rid)
    assert state["engine_over"] and state["published_tokens"] == 2 and state["generated_tokens"] == ack.generated_tokens
    rest = await collect(stream)
    assert not rest.frames and isinstance(rest.error, StreamBroken)  # closed without a word


async def test_a_stall_is_a_read_stall_to_the_client(sim_worker: WorkerProcess, sim_client: WorkerClient):
    rid = request_id()
    await add_fault(sim_worker.base_url, action="stall", at_token=2, match={"request_id": rid})
    got = await collect(await begin(sim_client, rid, read_timeout=0.5))
    assert isinstance(got.error, ReadStalled) and len(got.tokens) == 2
    assert got.error.kind is FailureKind.LIVENESS_UNCERTAIN and not got.error.released
    # the client gave up the stream: the worker saw it go and stopped the attempt
    ack = await sim_client.cancel(rid, 1, 1)
    assert (ack.state, ack.stop) == ("aborted", "disconnected")


async def test_a_stalled_attempt_is_stopped_when_its_lease_lapses(sim_worker: WorkerProcess, sim_client: WorkerClient):
    rid = request_id()
    await add_fault(sim_worker.base_url, action="stall", at_token=1, match={"request_id": rid})
    stream = await sim_client.start(
        request_id=rid, attempt=1, lease_epoch=1, lease_ttl_s=0.5, model="sim", prompt="x", params=LONG
    )
    got = await collect(stream)
    assert isinstance(got.error, StreamBroken) and len(got.tokens) == 1  # closed, without a word
    state = await attempt_state(sim_worker.base_url, rid)
    assert state["stop"] == "lease_expired" and state["engine_over"] and state["published_tokens"] == 1
    await asyncio.sleep(0.2)
    assert (await attempt_state(sim_worker.base_url, rid))["generated_tokens"] == state["generated_tokens"]


async def test_a_hold_publishes_nothing_until_released_then_goes_on_to_the_end(
    sim_worker: WorkerProcess, sim_client: WorkerClient
):
    rid = request_id()
    fault = await add_fault(sim_worker.base_url, action="hold", at_token=2, match={"request_id": rid})
    release = f"{sim_worker.base_url}/admin/faults/{fault['id']}/release"
    stream = await begin(sim_client, rid, params={"max_tokens": 8, "ignore_eos": True})
    got = await collect(stream, tokens=2)
    await asyncio.sleep(0.3)  # the sim's 8 tokens take a few ms: held, none more
    assert (await attempt_state(sim_worker.base_url, rid))["published_tokens"] == 2
    async with http_client() as http:
        assert (await http.post(release, json={"hold_at": 5})).status_code == 200
        more = await collect(stream, tokens=3)  # on to token 5, held there again
        await asyncio.sleep(0.3)
        assert (await attempt_state(sim_worker.base_url, rid))["published_tokens"] == 5
        answer = await http.post(release)
        assert answer.status_code == 200 and answer.json()["released"]["released"] is True
    rest = await collect(stream)
    assert rest.error is None and rest.done is not None and rest.done.finish_reason == "length"
    assert len(got.tokens) + len(more.tokens) + len(rest.tokens) == 8


async def test_a_release_names_a_hold_fault(sim_worker: WorkerProcess):
    stall = await add_fault(sim_worker.base_url, action="stall", at_token=2, match={"request_id": "nobody"})
    hold = await add_fault(sim_worker.base_url, action="hold", at_token=2, match={"request_id": "nobody"})
    async with http_client() as http:
        for fault_id in (stall["id"], 10_000):
            answer = await http.post(f"{sim_worker.base_url}/admin/faults/{fault_id}/release")
            assert answer.status_code == 404 and answer.json()["error"]["code"] == "not_found"
        answer = await http.post(f"{sim_worker.base_url}/admin/faults/{hold['id']}/release", json={"hold_at": -1})
        assert answer.status_code == 400 and answer.json()["error"]["field"] == "hold_at"


@pytest.mark.parametrize(
    ("fault", "error", "status", "code", "kind"),
    [
        ({"status": 429, "retry_after": 2}, Rejected, 429, "queue_full", FailureKind.REJECTED),
        ({"status": 503}, ReplicaExiting, 503, "replica_exiting", FailureKind.REPLICA_EXITED),
        ({"status": 503, "code": "not_ready"}, Rejected, 503, "not_ready", FailureKind.REJECTED),
    ],
)
async def test_reject_before_start(
    sim_worker: WorkerProcess,
    sim_client: WorkerClient,
    fault: dict[str, Any],
    error: type[Exception],
    status: int,
    code: str,
    kind: FailureKind,
):
    marker = request_id("reject")
    await add_fault(sim_worker.base_url, action="reject", match={"prompt_contains": marker}, **fault)
    with pytest.raises(error) as rejected:
        await begin(sim_client, request_id(), prompt=f"please {marker} now")
    assert (rejected.value.status, rejected.value.code, rejected.value.kind) == (status, code, kind)  # type: ignore[attr-defined]
    if "retry_after" in fault:
        assert rejected.value.retry_after == 2.0  # type: ignore[attr-defined]
    # used up: the same prompt starts now
    assert (await collect(await begin(sim_client, request_id(), prompt=f"{marker}", params={"max_tokens": 2}))).done


async def test_a_malformed_frame(sim_worker: WorkerProcess, sim_client: WorkerClient):
    rid = request_id()
    await add_fault(sim_worker.base_url, action="malformed_frame", at_token=2, match={"request_id": rid})
    got = await collect(await begin(sim_client, rid))
    assert isinstance(got.error, MalformedFrame) and len(got.tokens) == 2
    assert got.error.kind is FailureKind.LIVENESS_UNCERTAIN and got.error.line.startswith(b'{"type":"token"')
    assert (await sim_client.cancel(rid, 1, 1)).state == "aborted"


async def test_a_stream_closed_without_done(sim_worker: WorkerProcess, sim_client: WorkerClient):
    rid = request_id()
    await add_fault(sim_worker.base_url, action="close_without_done", at_token=3, match={"request_id": rid})
    got = await collect(await begin(sim_client, rid))
    assert isinstance(got.error, StreamBroken) and len(got.tokens) == 3
    state = await attempt_state(sim_worker.base_url, rid)
    assert state["stop"] == "fault" and state["engine_over"]


async def test_a_slow_prefill_heartbeats(sim_worker: WorkerProcess, sim_client: WorkerClient):
    rid = request_id()
    await add_fault(sim_worker.base_url, action="slow_prefill", prefill_ms=600, match={"request_id": rid})
    got = await collect(await begin(sim_client, rid, params={"max_tokens": 3}, heartbeat_s=0.1, read_timeout=0.3))
    assert got.done is not None and len(got.tokens) == 3
    before_first_token = got.frames[: got.frames.index(got.tokens[0])]
    assert len(before_first_token) >= 5 and all(h.phase == "prefill" for h in before_first_token)  # type: ignore[union-attr]


async def test_matchers_next_n_attempts_and_attempt_number(sim_worker: WorkerProcess, sim_client: WorkerClient):
    await add_fault(sim_worker.base_url, action="close_without_done", at_token=0, times=2)
    outcomes = [
        (await collect(await begin(sim_client, request_id(), params={"max_tokens": 2}))).error for _ in range(3)
    ]
    assert [type(e) for e in outcomes] == [StreamBroken, StreamBroken, type(None)]

    rid = request_id()
    await add_fault(sim_worker.base_url, action="close_without_done", match={"request_id": rid, "attempt": 2})
    first = await collect(await begin(sim_client, rid, params={"max_tokens": 2}))
    second = await collect(
        await sim_client.start(
            request_id=rid,
            attempt=2,
            lease_epoch=2,
            lease_ttl_s=30,
            model="sim",
            prompt="x",
            params={"max_tokens": 2},
        )
    )
    assert first.done is not None and isinstance(second.error, StreamBroken)


@pytest.mark.parametrize(
    ("fault", "code", "field"),
    [
        ({"action": "explode"}, "invalid_field", "action"),
        ({"action": "die", "point": "sometime"}, "invalid_field", "point"),
        ({"action": "reject", "at_token": 3}, "invalid_field", "at_token"),
        ({"action": "stall", "when": 3}, "unknown_field", "when"),
        ({"action": "stall", "match": {"model": "x"}}, "invalid_field", "match"),
    ],
)
async def test_a_bad_fault_is_refused(sim_worker: WorkerProcess, fault: dict[str, Any], code: str, field: str):
    async with http_client() as http:
        response = await http.post(sim_worker.base_url + "/admin/faults", json=fault)
    assert response.status_code == 400
    assert (response.json()["error"]["code"], response.json()["error"]["field"]) == (code, field)


async def test_faults_are_refused_without_the_flag():
    with running_worker() as worker:
        async with http_client() as http:
            for method in ("GET", "POST", "DELETE"):
                response = await http.request(method, worker.base_url + "/admin/faults", json={"action": "stall"})
                assert (response.status_code, response.json()["error"]["code"]) == (403, "faults_disabled")
    cli = [sys.executable, "-m", "app.cli", "worker", "--fault", '{"action": "stall"}']
    result = subprocess.run(cli, cwd=REPO, capture_output=True, text=True, timeout=30)
    assert result.returncode != 0 and "--enable-faults" in result.stderr


async def test_faults_are_listed_and_cleared(sim_worker: WorkerProcess):
    async with http_client() as http:
        await http.delete(sim_worker.base_url + "/admin/faults")
        added = (
            await http.post(
                sim_worker.base_url + "/admin/faults",
                json={"faults": [{"action": "stall", "at_token": 5, "times": None}]},
            )
        ).json()
        listed = (await http.get(sim_worker.base_url + "/admin/faults")).json()["faults"]
        assert listed == added["added"] and listed[0]["remaining"] is None
        assert (await http.delete(sim_worker.base_url + "/admin/faults")).json() == {"cleared": 1}
