"""Executing tool calls once: the ledger claim, then the configured webhook.

A tool call the model asks for is recorded as ``ToolCallEmitted`` with the
idempotency key ``{request_id}:{tool_call_id}``; the gateway names tool calls the
same way for every attempt, so a retry that asks for the same call meets the same
key. The ledger (``tool_executions``) lets the first claimer run it and nobody else.
Running it means POSTing it to ``tool_webhook_url`` with an ``Idempotency-Key``
header, so the receiving service can deduplicate too.
"""

from __future__ import annotations

from typing import Any

import httpx


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
