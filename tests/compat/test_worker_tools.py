"""A tool call through a ``phasegate worker --engine vllm`` goes through the tool ledger like
any other (docs/design.md §8, §10 case 5): the run's vLLM worker is forced by a named
``tool_choice`` to call a tool, which it streams in pieces as vLLM's server does; its
stream then ends before ``done``. The pieces reached the client, so there is no retry
(the first was the commit point): the client gets them and the structured error, and the
call, which the worker completed, ran once through the ledger. An attempt that broke before
its first piece is asked again, and the call runs once.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from app.config import ReplicaConfig
from statemachine import events as ev
from statemachine.request_state import Outcome
from tests.app.conftest import add_fault
from tests.compat.test_differential import TOOLS
from tests.faults.token_loop import tool_webhook
from tests.support.gateway import RunningGateway, running_gateway
from tests.support.transcript import check_request, of, stream_chat
from tests.support.vllm_replicas import MODEL, SharedVllm

pytestmark = pytest.mark.vllm

NAMED = {"type": "function", "function": {"name": "get_weather"}}


def forced_call(prompt: str) -> dict[str, Any]:
    """A chat request whose answer is the named tool's call: it goes on after a closed
    think block, and the forced call is all it says."""
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": "</think>"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
        "tools": TOOLS,
        "tool_choice": NAMED,
        "max_tokens": 200,
        "temperature": 0,
    }


@contextlib.contextmanager
def through_the_worker_then_vllm_serve(
    database_url: str, vllm: SharedVllm
) -> Iterator[tuple[RunningGateway, Callable[[], dict[str, int]]]]:
    """A gateway over the run's vLLM worker (attempt 1: ties go to the lower id) and then
    ``vllm serve``, with a real tool webhook; the gateway and the webhook's runs per key."""
    replicas = [
        ReplicaConfig(id="r1", url=vllm.worker().base_url, kind="worker"),
        ReplicaConfig(id="r2", url=vllm.server_url, kind="openai"),
    ]
    with (
        tool_webhook() as (url, runs),
        running_gateway(database_url, replicas, models={MODEL: "compat"}, tool_webhook_url=url) as gateway,
    ):
        yield gateway, runs


def test_a_forced_call_cut_after_its_pieces_is_not_retried_and_runs_once_through_the_ledger(
    database_url: str, vllm: SharedVllm
) -> None:
    prompt = f"the weather, {uuid.uuid4().hex[:12]}"
    # every frame of attempt 1 (the call's pieces, then the call whole), then the stream ends with no done
    add_fault(vllm.worker(), action="close_without_done", at_token=1_000_000, match={"prompt_contains": prompt})
    with through_the_worker_then_vllm_serve(database_url, vllm) as (gateway, runs):
        transcript = stream_chat(gateway.url, forced_call(prompt), timeout=120)
        events = gateway.events(transcript.request_id)
        assert [e.replica_id for e in of(events, ev.AttemptStarted)] == ["r1"]  # type: ignore[attr-defined]
        state = check_request(events, transcript)  # the client's deltas are the log's
        assert state.outcome is Outcome.FAILED and transcript.error is not None
        assert (transcript.error["code"], transcript.error["partial_output"]) == ("upstream_decode_interrupted", True)
        (emitted,) = of(events, ev.ToolCallEmitted)
        (delivered,) = transcript.calls  # the pieces, joined
        assert len(transcript.tool_calls) > 1
        assert delivered["id"] == emitted.client_tool_call_id  # type: ignore[attr-defined]
        assert delivered["function"]["name"] == emitted.name == "get_weather"  # type: ignore[attr-defined]
        assert delivered["function"]["arguments"] == emitted.arguments  # type: ignore[attr-defined]
        ledger = gateway.call(gateway.gateway.ctx.store.tool_execution(emitted.idempotency_key))  # type: ignore[attr-defined]
        assert ledger is not None and ledger.attempt == 1
        assert runs() == {emitted.idempotency_key: 1}  # type: ignore[attr-defined]  # executed once, through the ledger


def test_a_forced_call_whose_attempt_broke_before_its_first_piece_is_asked_again_and_runs_once(
    database_url: str, vllm: SharedVllm
) -> None:
    """The worker's attempt ends before it sent anything of the call (its stream closes at
    the first engine output): nothing reached the client, so the gateway asks again, on
    ``vllm serve``; the client gets that attempt's call whole in pieces, and the ledger runs
    it once, under the attempt that made it."""
    prompt = f"the weather, {uuid.uuid4().hex[:12]}"
    add_fault(vllm.worker(), action="close_without_done", at_token=0, match={"prompt_contains": prompt, "attempt": 1})
    with through_the_worker_then_vllm_serve(database_url, vllm) as (gateway, runs):
        transcript = stream_chat(gateway.url, forced_call(prompt), timeout=120)
        events = gateway.events(transcript.request_id)
        assert [e.replica_id for e in of(events, ev.AttemptStarted)] == ["r1", "r2"]  # type: ignore[attr-defined]
        state = check_request(events, transcript)
        assert state.outcome is Outcome.COMPLETED and transcript.error is None
        assert not [e for e in of(events, ev.DeltasDelivered) if e.attempt == 1]  # type: ignore[attr-defined]
        (emitted,) = of(events, ev.ToolCallEmitted)
        assert emitted.attempt == 2 and emitted.name == "get_weather"  # type: ignore[attr-defined]
        (delivered,) = transcript.calls
        assert delivered["function"]["arguments"] == emitted.arguments  # type: ignore[attr-defined]
        assert runs() == {emitted.idempotency_key: 1}  # type: ignore[attr-defined]  # asked twice, run once
