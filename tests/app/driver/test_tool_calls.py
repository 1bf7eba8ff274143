"""Tool calls are named by their content (docs/design.md §8), through the real driver.

The first attempt, on a sim worker, asks for one call and its worker dies; the retry,
on a scripted OpenAI-compatible upstream, asks for another. A different call is a
different action: it gets its own id and ledger entry and runs, and the client
receives the retry's call, streamed under its upstream's id, never under an id whose
ledger entry holds the first attempt's call. (An identical call on a retry reusing its one
execution is tests/faults/test_token_loop.py's test 5.)
"""

from __future__ import annotations

import json
from collections.abc import Callable

from app.config import ReplicaConfig
from statemachine import events as ev
from statemachine.request_state import Outcome
from statemachine.state import fold
from tests.app.conftest import add_fault
from tests.support.gateway import MODEL, running_gateway
from tests.support.scripted_upstream import running_scripted_upstream
from tests.support.transcript import of, stream_chat
from tests.support.workers import WorkerProcess

TOOLS = [
    {
        "type": "function",
        "function": {"name": "lookup", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
    }
]


def test_a_retry_that_asks_for_another_call_runs_it_under_its_own_id(
    database_url: str, fresh_pair: list[WorkerProcess], unique_prompt: Callable[[str], str]
) -> None:
    prompt = unique_prompt("which tool")
    worker = fresh_pair[0]  # asks for its own call (the sim's, from the schema), then dies
    add_fault(worker, action="tool_call_then_die", at_token=0, match={"prompt_contains": prompt, "attempt": 1})
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "tools": TOOLS}
    with running_scripted_upstream() as upstream:
        upstream.script({"attempt": 2, "tool": "lookup", "arguments": '{"city": "somewhere else"}'})
        replicas = [
            ReplicaConfig(id="r1", url=worker.base_url),  # ties go to the lower id: attempt 1
            ReplicaConfig(id="r2", url=upstream.base_url, kind="openai"),
        ]
        webhook = upstream.base_url + "/tools/execute"
        with running_gateway(database_url, replicas, tool_webhook_url=webhook) as gateway:
            transcript = stream_chat(gateway.url, body)
            events = gateway.events(transcript.request_id)
            assert [e.replica_id for e in of(events, ev.AttemptStarted)] == ["r1", "r2"]  # type: ignore[attr-defined]
            first, second = of(events, ev.ToolCallEmitted)
            assert (first.attempt, second.attempt) == (1, 2)  # type: ignore[attr-defined]
            assert json.loads(second.arguments) == {"city": "somewhere else"}  # type: ignore[attr-defined]
            assert first.arguments != second.arguments  # type: ignore[attr-defined]
            assert first.tool_call_id != second.tool_call_id  # type: ignore[attr-defined]
            # the client got the retry's call, as its upstream streamed it and under its id,
            # which the log names beside the ledger's (never the first attempt's)
            (delivered,) = transcript.calls
            assert delivered["id"] == second.client_tool_call_id == "call_upstream"  # type: ignore[attr-defined]
            assert first.client_tool_call_id is None  # type: ignore[attr-defined]  # a worker's: sent whole
            assert delivered["function"]["arguments"] == second.arguments  # type: ignore[attr-defined]
            assert fold(events).outcome is Outcome.COMPLETED
            # each call has its own ledger entry, holding its own call, and ran once
            for emitted in (first, second):
                key = emitted.idempotency_key  # type: ignore[attr-defined]
                entry = gateway.call(gateway.gateway.ctx.store.tool_execution(key))
                assert entry is not None and entry.attempt == emitted.attempt  # type: ignore[attr-defined]
                assert entry.arguments == emitted.arguments  # type: ignore[attr-defined]
            assert upstream.tool_runs == {first.idempotency_key: 1, second.idempotency_key: 1}  # type: ignore[attr-defined]
