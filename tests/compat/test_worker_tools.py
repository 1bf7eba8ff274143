"""A tool call through a ``phasegate worker --engine vllm`` goes through the tool ledger like
any other (DESIGN.md §8, §10 case 5): the run's vLLM worker is forced by a named
``tool_choice`` to call a tool, its stream ends before ``done``, the request is retried
before anything reached the client on the run's ``vllm serve`` (the same model and
parsers), which asks for the same call, and the ledger runs it once.
"""

from __future__ import annotations

import uuid

import pytest

from app.config import ReplicaConfig
from statemachine import events as ev
from statemachine.request_state import Outcome
from statemachine.state import fold
from tests.app.conftest import add_fault
from tests.compat.test_differential import TOOLS
from tests.faults.token_loop import tool_webhook
from tests.support.gateway import running_gateway
from tests.support.transcript import of, stream_chat
from tests.support.vllm_replicas import MODEL, SharedVllm

pytestmark = pytest.mark.vllm

NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_a_forced_call_retried_before_the_first_delta_runs_once_through_the_ledger(
    database_url: str, vllm: SharedVllm
) -> None:
    prompt = f"the weather, {uuid.uuid4().hex[:12]}"
    worker = vllm.worker()
    # every frame of attempt 1 (the call among them), then the stream ends with no done
    add_fault(worker, action="close_without_done", at_token=1_000_000, match={"prompt_contains": prompt})
    replicas = [
        ReplicaConfig(id="r1", url=worker.base_url, kind="worker"),  # ties go to the lower id: attempt 1
        ReplicaConfig(id="r2", url=vllm.server_url, kind="openai"),
    ]
    body = {
        "model": MODEL,
        # the answer goes on after a closed think block: the forced call is all it says
        "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": "</think>"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
        "tools": TOOLS,
        "tool_choice": NAMED,
        "max_tokens": 200,
        "temperature": 0,
    }
    with (
        tool_webhook() as (url, runs),
        running_gateway(database_url, replicas, models={MODEL: "compat"}, tool_webhook_url=url) as gateway,
    ):
        transcript = stream_chat(gateway.url, body, timeout=120)
        events = gateway.events(transcript.request_id)
        assert [e.replica_id for e in of(events, ev.AttemptStarted)] == ["r1", "r2"]  # type: ignore[attr-defined]
        emitted = of(events, ev.ToolCallEmitted)
        assert [e.attempt for e in emitted] == [1, 2]  # type: ignore[attr-defined]
        (key,) = {e.idempotency_key for e in emitted}  # type: ignore[attr-defined]  # the same call
        ledger = gateway.call(gateway.gateway.ctx.store.tool_execution(key))
        assert ledger is not None and ledger.attempt == 1
        assert runs() == {key: 1}  # executed once, through the ledger
        assert fold(events).outcome is Outcome.COMPLETED
        # the client got the call once, in the pieces vllm serve streamed (attempt 2), under
        # the id it gave, which the log names beside the ledger's
        (delivered,) = transcript.calls
        assert len(transcript.tool_calls) > 1
        assert delivered["id"] == emitted[-1].client_tool_call_id  # type: ignore[attr-defined]
        assert delivered["name"] == "get_weather"
        assert delivered["arguments"] == emitted[-1].arguments  # type: ignore[attr-defined]
