"""docs/design.md §10, 5: a replica dies after a tool call was emitted: the call runs once,
through the ledger, however many attempts ask (tests/faults/token_loop.py). Through an
OpenAI upstream, which streams a call in pieces and so emits it only with its stream's
end, the death cuts the call after its first piece reached the client: no retry, and
nothing run."""

from __future__ import annotations

import pytest

from statemachine import events as ev
from statemachine.request_state import Outcome
from tests.faults.conftest import Evidence, Fleet
from tests.faults.token_loop import (
    INDICES,
    TIMEOUTS,
    body,
    prompt_for,
    replicas_of,
    settle,
    tool_webhook,
)
from tests.support.gateway import running_gateway
from tests.support.transcript import of, stream_chat

# --- 5. death after a tool call was emitted ----------------------------------------------------


TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("k", INDICES)
def test_5_a_tool_call_runs_once_however_many_attempts_ask(
    database_url: str, live_fleet: Fleet, evidence: Evidence, k: int
) -> None:
    if live_fleet.kind == "openai" and k > 0:
        pytest.skip("the scripted OpenAI upstream streams its tool call first: only k = 0 exists there")
    prompt = prompt_for(f"tool {k}")
    live_fleet.fault_first_attempt(prompt, "tool_call_then_die", k=k)
    # k = 0: the request offers tools and the replica's own first output is the call;
    # k > 0: k content deltas reach the client, then the replica asks for a tool and dies
    request = body(prompt, tools=TOOLS) if k == 0 else body(prompt)
    with (
        tool_webhook() as (url, runs),
        running_gateway(
            database_url, live_fleet.configs, timeouts=TIMEOUTS, tool_webhook_url=url, health_interval_s=30
        ) as gateway,
    ):
        transcript = stream_chat(gateway.url, request)
        events, state = settle(gateway, transcript, evidence)
        emitted = of(events, ev.ToolCallEmitted)
        if live_fleet.kind == "openai":
            # an OpenAI upstream streams the call: its first piece reached the client (the
            # commit point), so the death that cut the call ends the stream, with no retry;
            # the call was never whole, so the ledger ran nothing
            assert state.outcome is Outcome.FAILED and replicas_of(events) == ["r1"]
            assert transcript.error is not None and transcript.error["code"] == "upstream_decode_interrupted"
            assert transcript.error["partial_output"] is True
            assert [c["function"]["name"] for c in transcript.tool_calls] == ["lookup"]
            assert emitted == [] and runs() == {}
            return
        keys = {e.idempotency_key for e in emitted}  # type: ignore[attr-defined]
        assert len(keys) == 1, "every attempt that asked named the same call"
        (key,) = keys
        ledger = gateway.call(gateway.gateway.ctx.store.tool_execution(key))
        assert ledger is not None and ledger.attempt == emitted[0].attempt  # type: ignore[attr-defined]
        assert runs() == {key: 1}  # executed once, through the ledger
    if k > 0:  # the stream was already delivering: it ends, the call is never delivered
        assert state.outcome is Outcome.FAILED and len(emitted) == 1 and not transcript.tool_calls
        return
    assert replicas_of(events) == ["r1", "r2"] and state.outcome is Outcome.COMPLETED
    assert [c["id"] for c in transcript.tool_calls] == [emitted[-1].tool_call_id]  # type: ignore[attr-defined]
    assert [e.attempt for e in emitted] == [1, 2]  # type: ignore[attr-defined]  # a worker publishes the call whole
