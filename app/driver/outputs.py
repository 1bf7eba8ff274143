"""What a request driver yields for its client; the HTTP layer renders each one.

The driver says what happened in the domain's words; how it looks on the wire
(an SSE chunk, an OpenAI error body, an HTTP status) is the API's business.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from app.contract.logprobs import TokenLogprob
from app.replicas.base import PooledAnswer as PooledAnswer  # the answer a Finished carries, for the API
from statemachine.actions import FailRequest
from statemachine.deltas import CONTENT, Prompt, PromptLogprobs


@dataclass(slots=True)  # not frozen: one a token, and frozen fields are set one slow call each
class Delta:
    text: str
    choice: int = 0
    tokens: int = 1  # engine tokens in it (docs/design.md §11: delivered_output_tokens counts these)
    logprobs: tuple[TokenLogprob, ...] | None = None  # asked for: one per token (app/contract/logprobs.py)
    key: str = CONTENT  # the key of the client's delta that carries the text (reasoning, …)
    token_ids: Sequence[int] = ()  # its tokens' ids, where the client asked for them (return_token_ids)
    prompt: Prompt | None = None  # what the replica said of the choice's prompt, before its first delta
    # the prompt's tokens as the replica counted them, with the choice's first delta where the
    # client asked for the usage in every chunk (``continuous_usage_stats``)
    prompt_tokens: int | None = None
    # the prompt's log probabilities, with the choice's first delta where the client asked a
    # whole answer with them (vLLM's ``prompt_logprobs``)
    prompt_logprobs: PromptLogprobs | None = None


@dataclass(frozen=True, slots=True)
class Restarted:
    """A new attempt replaced one whose output never reached the client: drop it."""


@dataclass(frozen=True, slots=True)
class Finished:
    finish_reasons: tuple[str, ...]
    usage: dict[str, int]
    tool_calls: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    stop_reasons: tuple[str | int | None, ...] = ()  # per choice, as the replica said
    usage_details: dict[str, Any] | None = None  # the usage's other fields (prompt_tokens_details, …)
    answer: PooledAnswer | None = None  # a pooling request's whole answer (docs/design.md §17)

    @property
    def full_usage(self) -> dict[str, Any]:
        return full_usage(self.usage, self.usage_details)


def full_usage(usage: dict[str, int], details: dict[str, Any] | None) -> dict[str, Any]:
    """The usage as the replica gave it: the counts and their details (a log's, or a live answer's)."""
    return {**usage, **details} if details else usage


@dataclass(frozen=True, slots=True)
class Failed:
    """The request failed; the fields of the error the client is told (docs/design.md §6)."""

    code: str
    message: str
    partial_output: bool
    delivered_output_tokens: int
    retryable: bool
    http_status: int  # when no header went out yet; else the stream's final error event
    param: str | None = None  # the client's parameter at fault, where a replica's refusal named one

    @classmethod
    def decided(cls, action: FailRequest, param: str | None = None) -> Failed:
        """What the client is told of a failure the policy decided."""
        return cls(
            code=action.code,
            message=action.message,
            partial_output=action.partial_output,
            delivered_output_tokens=action.delivered_output_tokens,
            retryable=action.retryable,
            http_status=action.http_status,
            param=param,
        )


@dataclass(frozen=True, slots=True)
class Cancelled:
    reason: str


Output = Delta | Restarted | Finished | Failed | Cancelled
