"""Tool calls: named, recorded, and executed once (the ledger claim, then the webhook).

A tool call the model asks for is recorded as ``ToolCallEmitted`` with the
idempotency key ``{request_id}:{tool_call_id}``. The gateway names each call by its
content (docs/design.md §8): the choice, the function's name, the canonical arguments and
how many identical calls came before it in the attempt. So a retry that asks for the
same call meets the same key and reuses its one execution, and a retry that asks for
a different call gets a new key and runs it. The ledger (``tool_executions``) lets
the first claimer run it and nobody else. Running it means POSTing it to
``tool_webhook_url`` with an ``Idempotency-Key`` header, so the receiving service
can deduplicate too.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import httpx

from app.driver.context import GatewayContext, ToolRunner
from app.driver.recorder import Recorder
from app.replicas.base import ToolCallFrame
from app.store.content import kept_text, kept_tool_result, kept_tool_text
from statemachine import events as ev


def canonical_arguments(arguments: str) -> str:
    """The arguments as sorted, compact JSON; as they came when they are not JSON."""
    try:
        return json.dumps(json.loads(arguments), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except ValueError:
        return arguments


def call_id(request_id: str, choice: int, name: str, arguments: str, occurrence: int) -> str:
    """The gateway's id for a tool call, from its content (the same for every attempt)."""
    material = "\0".join((request_id, str(choice), name, arguments, str(occurrence)))
    return "call_" + hashlib.sha256(material.encode()).hexdigest()[:24]


class ToolCalls:
    """The tool calls of one request's current attempt, by choice, as the client gets them."""

    def __init__(self, ctx: GatewayContext, recorder: Recorder) -> None:
        self.ctx = ctx
        self.recorder = recorder
        self.by_choice: dict[int, list[dict[str, Any]]] = {}
        self._occurrences: dict[tuple[int, str, str], int] = {}  # identical calls so far, this attempt

    def restart(self) -> None:
        """A new attempt: the calls of the one before never reached the client."""
        self.by_choice = {}
        self._occurrences = {}

    async def emitted(self, attempt: int, lease_epoch: int, frame: ToolCallFrame) -> None:
        """The attempt asked for a tool call: record it, and run it unless the ledger
        says another attempt already claimed it."""
        request_id = self.recorder.request_id
        content = (frame.choice, frame.name, canonical_arguments(frame.arguments))
        occurrence = self._occurrences.get(content, 0)
        self._occurrences[content] = occurrence + 1
        tool_call_id = call_id(request_id, *content, occurrence)
        key = f"{request_id}:{tool_call_id}"
        policy = self.recorder.content_policy
        arguments, arguments_sha256 = kept_text(frame.arguments, policy)  # the log keeps what the policy says
        self.recorder.record(
            ev.ToolCallEmitted,
            attempt=attempt,
            lease_epoch=lease_epoch,
            index=frame.index,
            tool_call_id=tool_call_id,
            name=frame.name,
            arguments=arguments or "",
            idempotency_key=key,
            arguments_sha256=arguments_sha256,
            client_tool_call_id=frame.id if frame.streamed else None,
        )
        call = {"id": tool_call_id, "type": "function", "function": {"name": frame.name, "arguments": frame.arguments}}
        if not frame.streamed:  # the client gets it whole, with the answer's end
            self.by_choice.setdefault(frame.choice, []).append(call)
        runner = self.ctx.tool_runner
        if runner is not None and await self.ctx.store.claim_tool_execution(
            key, request_id, attempt, tool_call_id, frame.name, kept_tool_text(frame.arguments, policy) or ""
        ):
            self.ctx.spawn(self._execute(runner, key, call), name=f"tool {key}")

    async def _execute(self, runner: ToolRunner, key: str, call: dict[str, Any]) -> None:
        """Run the call (with its arguments in full); the ledger keeps what the content policy says."""
        policy = self.recorder.content_policy
        try:
            result = await runner({"idempotency_key": key, "request_id": self.recorder.request_id, **call})
        except Exception as exc:
            await self.ctx.store.record_tool_result(key, error=kept_tool_text(repr(exc), policy))
        else:
            await self.ctx.store.record_tool_result(key, result=kept_tool_result(result, policy))


class WebhookRunner:
    """A tool runner that POSTs each call to one URL; close it with the gateway."""

    def __init__(self, url: str, *, timeout_s: float = 10.0) -> None:
        self.url = url
        self._http = httpx.AsyncClient(timeout=timeout_s)

    async def __call__(self, call: dict[str, Any]) -> Any:
        response = await self._http.post(self.url, json=call, headers={"idempotency-key": call["idempotency_key"]})
        response.raise_for_status()
        return response.json() if response.content else None

    async def aclose(self) -> None:
        await self._http.aclose()
