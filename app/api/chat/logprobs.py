"""Tokens' log probabilities as a chat completion or a completion sends them (chat's
``content`` list, or the legacy completions' columns), streamed or whole."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from app.contract.logprobs import TokenLogprob, chat_bytes
from statemachine.deltas import PromptLogprobs


def render_logprobs(entries: Sequence[TokenLogprob], *, chat: bool, text_offset: int) -> dict[str, Any]:
    """Tokens' log probabilities as OpenAI sends them: chat's ``content`` list, or the legacy
    completions' columns (``text_offset``: where the first token starts in the choice's text)."""
    if chat:
        return {
            "content": [
                {
                    "token": entry[0],
                    "logprob": entry[1],
                    "bytes": chat_bytes(entry),
                    "top_logprobs": [
                        {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8", "replace"))} for t, lp in entry[2]
                    ],
                }
                for entry in entries
            ]
        }
    offsets = []
    for entry in entries:
        offsets.append(text_offset)
        text_offset += len(entry[0])
    return {
        "tokens": [entry[0] for entry in entries],
        "token_logprobs": [entry[1] for entry in entries],
        "top_logprobs": [None if entry[1] is None else dict(entry[2]) for entry in entries],
        "text_offset": offsets,
    }


def render_prompt_logprobs(said: PromptLogprobs | None) -> list[dict[str, dict[str, Any]] | None] | None:
    """The prompt's log probabilities as vLLM's whole answer gives them (``prompt_logprobs``):
    per prompt token ``null`` (the first) or its token and the likeliest at its place by
    token id, each ``{logprob, rank, decoded_token}``, in vLLM's order (clamped as vLLM's
    server clamps them: the log holds them so)."""
    if said is None:
        return None
    return [
        None
        if place is None
        else {str(token_id): {"logprob": lp, "rank": rank, "decoded_token": text} for token_id, lp, rank, text in place}
        for place in said
    ]
