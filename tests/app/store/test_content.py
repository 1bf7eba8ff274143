"""What the log keeps of content (docs/design.md §13): recorded inputs follow
``content_policy``, and ``phasegate tenants erase`` removes a tenant's content while
the event skeleton stays, and the fold, the read models and replay still agree.
Real gateway, real sim workers, real PostgreSQL, the real ``openai`` client."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from typing import Any

import pytest

from app import cli
from app.store import PostgresEventStore
from ops import traces
from statemachine import events as ev
from statemachine.replay import replay
from statemachine.state import fold
from tests.conftest import run_sync
from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.transcript import of
from tests.support.workers import WorkerProcess

KEYS = {"key-a": "team-a", "key-b": "team-b"}
ARGUMENTS = '{"city": "Paris"}'


def served(gateway: RunningGateway, key: str, content: str, *, stream: bool) -> str:
    client = gateway.openai(api_key=key)
    messages = [{"role": "user", "content": content}]
    if stream:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=6, stream=True
        )
        for _ in raw.parse():
            pass
    else:
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=6)
    request_id: str = raw.headers["x-request-id"]
    gateway.events(request_id)  # settled: the input is written too
    return request_id


@pytest.mark.parametrize("policy", ["full", "digest", "none"])
def test_recorded_inputs_follow_the_content_policy(
    database_url: str, sim_pair: list[WorkerProcess], policy: str
) -> None:
    with running_gateway(database_url, sim_pair, content_policy=policy) as gateway:
        request_id = served(gateway, "any", "a secret prompt", stream=True)
        recorded = gateway.call(gateway.gateway.ctx.store.read_input(request_id))
        delivered = [e for e in gateway.events(request_id) if isinstance(e, ev.DeltasDelivered)]
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "a secret prompt"}],
        "max_tokens": 6,
        "stream": True,
    }
    if policy == "full":
        assert recorded is not None and recorded.body == body
        assert all(e.text for e in delivered)
    elif policy == "digest":
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        assert recorded is not None and recorded.body == {"sha256": hashlib.sha256(canonical.encode()).hexdigest()}
        assert all(e.text is None and e.text_sha256 for e in delivered)
    else:
        assert recorded is None  # nothing, not even a row
        assert all(e.text is None and e.text_sha256 is None for e in delivered)


async def add_tool_request(url: str, request_id: str, tenant: str) -> list[ev.Event]:
    trace = traces.Trace(request_id, tenant=tenant).start("w1").first_token().first_delta().deliver("Sunny")
    trace.tool_call("call_1", "get_weather", ARGUMENTS).completed()
    store = await PostgresEventStore.connect(url)
    try:
        await store.append(request_id, 0, trace.events)
        await store.claim_tool_execution(f"{request_id}:call_1", request_id, 1, "call_1", "get_weather", ARGUMENTS)
        await store.record_tool_result(f"{request_id}:call_1", result={"forecast": "sunny in Paris"})
        await store.record_input(request_id, {"messages": [{"role": "user", "content": "weather in Paris?"}]})
    finally:
        await store.close()
    return trace.events


async def read_all(url: str, request_ids: list[str]) -> dict[str, tuple[list[ev.Event], object, object]]:
    store = await PostgresEventStore.connect(url)
    try:
        found = {}
        for request_id in request_ids:
            tool = await store.tool_execution(f"{request_id}:call_1")
            found[request_id] = (await store.read(request_id), await store.read_input(request_id), tool)
        return found
    finally:
        await store.close()


def skeleton(events: list[ev.Event]) -> list[tuple[object, ...]]:
    return [(type(e).__name__, e.seq, e.occurred_at, getattr(e, "tokens", None)) for e in events]


def test_erasing_a_tenant_keeps_the_skeleton_and_the_fold(
    database_url: str,
    sim_pair: list[WorkerProcess],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    with running_gateway(database_url, sim_pair, api_keys=KEYS) as gateway:
        team_a = [served(gateway, "key-a", "team a's secret", stream=stream) for stream in (True, False)]
        team_b = [served(gateway, "key-b", "team b's secret", stream=True)]
    run_sync(lambda: add_tool_request(database_url, "req_tool_a", "team-a"))
    run_sync(lambda: add_tool_request(database_url, "req_tool_b", "team-b"))
    team_a.append("req_tool_a")
    team_b.append("req_tool_b")
    before = run_sync(lambda: read_all(database_url, team_a + team_b))

    monkeypatch.setenv("DATABASE_URL", database_url)
    assert cli.main(["tenants", "erase", "team-a"]) == 0
    out = capsys.readouterr().out
    assert "tenant team-a: 3 request(s)" in out and "1 tool execution(s) and 3 recorded input(s)" in out
    after = run_sync(lambda: read_all(database_url, team_a + team_b))

    for request_id in team_a:
        events, recorded, tool = after[request_id]
        old_events = before[request_id][0]
        assert skeleton(events) == skeleton(old_events)  # every event stays, in order, with its counts
        assert recorded is None
        for event in events:
            assert not isinstance(event, ev.DeltasDelivered) or (event.text is None and event.text_sha256 is None)
            assert not isinstance(event, ev.ToolCallEmitted) or (event.arguments, event.arguments_sha256) == ("", None)
        folded, old = fold(events), fold(old_events)
        assert (folded.outcome, folded.delivered_output_tokens, folded.delivered_deltas, folded.attempts) == (
            old.outcome,
            old.delivered_output_tokens,
            old.delivered_deltas,
            old.attempts,
        )
        assert replay(events).divergence is None
    _, _, tool = after["req_tool_a"]
    assert tool is not None
    assert (tool.arguments, tool.result, tool.error, tool.status) == ("", None, None, "succeeded")  # type: ignore[attr-defined]
    for request_id in team_b:  # another tenant's content is untouched
        assert after[request_id] == before[request_id]
    dumped = json.dumps([dataclasses.asdict(e) for r in team_a for e in after[r][0]], default=str)
    assert "Paris" not in dumped and "Sunny" not in dumped

    assert cli.main(["db", "check"]) == 0  # the read models still agree with the fold
    assert cli.main(["replay", "-q", *team_a]) == 0
    capsys.readouterr()
    assert cli.main(["tenants", "erase", "team-a"]) == 0  # again: nothing more to remove
    assert "content removed from 0 event(s), 0 tool execution(s) and 0 recorded input(s)" in capsys.readouterr().out


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"properties": {"city": {}}}}}
BROKEN = {"type": "function", "function": {"name": "broken_tool", "parameters": {"properties": {"x": {}}}}}


async def run_tool(call: dict[str, object]) -> object:
    function = call["function"]
    assert isinstance(function, dict) and json.loads(function["arguments"])  # the runner gets them in full
    if function["name"] == "broken_tool":
        raise RuntimeError(f"tool failed on {function['arguments']}")
    return {"forecast": f"sunny for {function['arguments']}"}


def tool_request(gateway: RunningGateway, tool: dict[str, object]) -> tuple[str, str]:
    answer = gateway.openai().chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "weather?"}],
        tools=[tool],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": tool["function"]["name"]}},  # type: ignore[index]
    )
    (call,) = answer.parse().choices[0].message.tool_calls or []
    return answer.headers["x-request-id"], call.function.arguments


@pytest.mark.parametrize("policy", ["full", "digest", "none"])
def test_tool_data_follows_the_content_policy(database_url: str, sim_pair: list[WorkerProcess], policy: str) -> None:
    with running_gateway(database_url, sim_pair, content_policy=policy, tool_runner=run_tool) as gateway:
        kept = {}
        for tool in (WEATHER, BROKEN):
            request_id, arguments = tool_request(gateway, tool)
            (emitted,) = of(gateway.events(request_id), ev.ToolCallEmitted)
            ledger = wait_for_outcome(gateway, emitted.idempotency_key)  # type: ignore[attr-defined]
            kept[tool["function"]["name"]] = (arguments, emitted, ledger)  # type: ignore[index]
    for name, (arguments, emitted, ledger) in kept.items():
        digest = hashlib.sha256(arguments.encode()).hexdigest()
        assert ledger.status == ("failed" if name == "broken_tool" else "succeeded")
        if policy == "full":
            assert (emitted.arguments, emitted.arguments_sha256, ledger.arguments) == (arguments, None, arguments)
            assert name != "get_weather" or ledger.result == {"forecast": f"sunny for {arguments}"}
            assert name != "broken_tool" or arguments in ledger.error
        elif policy == "digest":
            assert (emitted.arguments, emitted.arguments_sha256, ledger.arguments) == ("", digest, f"sha256:{digest}")
            result = json.dumps({"forecast": f"sunny for {arguments}"}, sort_keys=True, separators=(",", ":"))
            assert name != "get_weather" or ledger.result == {"sha256": hashlib.sha256(result.encode()).hexdigest()}
            assert name != "broken_tool" or (ledger.error.startswith("sha256:") and arguments not in ledger.error)
        else:
            assert (emitted.arguments, emitted.arguments_sha256) == ("", None)
            assert (ledger.arguments, ledger.result) == ("", None)
            assert name != "broken_tool" or ledger.error == ""


def wait_for_outcome(gateway: RunningGateway, key: str) -> Any:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        execution = gateway.call(gateway.gateway.ctx.store.tool_execution(key))
        if execution is not None and execution.status != "claimed":
            return execution
        time.sleep(0.05)
    raise AssertionError(f"the tool execution {key} never finished")
