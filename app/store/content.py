"""What the log keeps of content (docs/design.md §13): recorded inputs, delivered text and
tool data under the content policy, and a tenant's content erased while its events stay.

Content is what a client sent or was sent: the request's body (``request_inputs``),
the delivered and produced text (``DeltasDelivered.text``, ``DeltasProduced.text``, or
their digests, and the log probabilities kept with the delivered text), tool call
arguments (``ToolCallEmitted.arguments`` and the ledger's ``arguments``), and tool
results and errors (``tool_executions``). Everything else is the event skeleton: what happened,
when, where, how many tokens. The fold and replay read only the skeleton, so they
work on an erased log as on one recorded under the ``none`` policy.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text

from app.contract import json_depth as deep_json
from app.store.queries import ended

POLICIES = ("none", "digest", "full")  # from keeping the least to the most


def stricter(content_policy: str, other: str) -> str:
    """The policy of the two that keeps less (a request's own, under the gateway's)."""
    return min(content_policy, other, key=POLICIES.index)


def kept_input(body: dict[str, Any], content_policy: str) -> dict[str, Any] | None:
    """What ``request_inputs`` keeps of a request's body: all of it (``full``), the
    SHA-256 of its canonical JSON (``digest``), or nothing, not even a row (``none``)."""
    if content_policy == "full":
        return body
    if content_policy == "digest":
        canonical = deep_json.dumps(body, sort_keys=True)
        return {"sha256": sha256_of(canonical)}
    return None


def sha256_of(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def kept_text(text: str, content_policy: str) -> tuple[str | None, str | None]:
    """What the log keeps of a text sent or received: ``(text, None)`` (``full``),
    ``(None, its SHA-256)`` (``digest``) or ``(None, None)`` (``none``)."""
    if content_policy == "full":
        return text, None
    return None, (sha256_of(text) if content_policy == "digest" else None)


def kept_tool_text(text: str | None, content_policy: str) -> str | None:
    """A tool call's text in the ledger (its arguments, an execution's error): in full,
    ``sha256:`` and its digest, or nothing (``""`` where the column needs a value)."""
    if text is None or content_policy == "full":
        return text
    return f"sha256:{sha256_of(text)}" if content_policy == "digest" else ""


def kept_tool_result(result: Any, content_policy: str) -> Any:
    """A tool's answer in the ledger: in full, ``{"sha256": …}`` of its canonical JSON, or ``None``."""
    if result is None or content_policy == "full":
        return result
    if content_policy == "digest":
        canonical = json.dumps(result, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
        return {"sha256": sha256_of(canonical)}
    return None


@dataclass(frozen=True, slots=True)
class Erased:
    """What ``erase_tenant`` found and changed."""

    requests: int  # the tenant's requests in the log
    unfinished: int  # of them still open: their later events may hold content again
    events: int  # events whose content was removed
    tool_executions: int
    inputs: int


# A tenant's requests through its read model's index on the tenant; one request from the
# log (its RequestAccepted), so that erasing it needs no row that may trail (docs/design.md §8)
_OF_TENANT = "SELECT request_id FROM requests WHERE tenant = :tenant"
_COUNT_OF_TENANT = (
    f"SELECT count(*), count(*) FILTER (WHERE outcome IS NULL) FROM requests WHERE request_id IN ({_OF_TENANT})"
)
_ACCEPTED = """request_events accepted
 WHERE accepted.request_id = :request_id AND accepted.version = 1 AND accepted.body->>'tenant' = :tenant"""
_OF_REQUEST = f"SELECT accepted.request_id FROM {_ACCEPTED}"
_COUNT_OF_REQUEST = f"SELECT count(*), count(*) FILTER (WHERE NOT {ended('accepted')}) FROM {_ACCEPTED}"


def _erasing(of: str, count_of: str) -> tuple[Any, Any, Any, Any]:
    """The statements that count (``count_of``: the requests, the unfinished among them) and
    erase the content of the requests ``of`` selects."""
    count = text(count_of)
    # as if recorded under the "none" policy: no text and no digest; arguments as a redacted
    # trace writes them (statemachine/trace.py)
    events = text(
        f"""
        UPDATE request_events SET body = CASE type
            WHEN 'ToolCallEmitted' THEN body || '{{"arguments": "", "arguments_sha256": null}}'::jsonb
            WHEN 'DeltasDelivered'
            THEN (body - 'token_ids' - 'prompts' - 'prompt_logprobs')
                 || '{{"text": null, "text_sha256": null, "logprobs": null}}'::jsonb
            ELSE (body - 'logprobs' - 'token_ids' - 'prompts' - 'prompt_logprobs')
                 || '{{"text": null, "text_sha256": null}}'::jsonb END
         WHERE request_id IN ({of})
           AND ((type IN ('DeltasDelivered', 'DeltasProduced')
                 AND (body->>'text' IS NOT NULL OR body->>'text_sha256' IS NOT NULL))
             OR (type = 'ToolCallEmitted' AND (body->>'arguments' <> '' OR body->>'arguments_sha256' IS NOT NULL)))
        """
    )
    tools = text(
        f"""
        UPDATE tool_executions SET arguments = '', result = NULL, error = NULL
         WHERE request_id IN ({of}) AND (arguments <> '' OR result IS NOT NULL OR error IS NOT NULL)
        """
    )
    inputs = text(f"DELETE FROM request_inputs WHERE request_id IN ({of})")
    return count, events, tools, inputs


_OF_A_TENANT = _erasing(_OF_TENANT, _COUNT_OF_TENANT)
_OF_ONE_REQUEST = _erasing(_OF_REQUEST, _COUNT_OF_REQUEST)


async def erase_tenant(connection: Any, tenant: str) -> Erased:
    """Remove ``tenant``'s content from the log, in the caller's transaction; the events,
    their order and every count stay. Running it again changes nothing more."""
    return await _erase(connection, _OF_A_TENANT, {"tenant": tenant})


async def erase_one_request(connection: Any, tenant: str, request_id: str) -> Erased:
    """The same for one request of ``tenant`` (none of another tenant's)."""
    return await _erase(connection, _OF_ONE_REQUEST, {"tenant": tenant, "request_id": request_id})


async def _erase(connection: Any, statements: tuple[Any, Any, Any, Any], values: dict[str, str]) -> Erased:
    count, events, tools, inputs = statements
    requests, unfinished = (await connection.execute(count, values)).one()
    return Erased(
        requests=requests,
        unfinished=unfinished,
        events=(await connection.execute(events, values)).rowcount,
        tool_executions=(await connection.execute(tools, values)).rowcount,
        inputs=(await connection.execute(inputs, values)).rowcount,
    )
