"""The prompt's log probabilities from vLLM's engine (``prompt_logprobs``), as vLLM's server
gives them in a whole answer, for the worker's ``prompt_logprobs`` frame (docs/worker-protocol.md)."""

from __future__ import annotations

from typing import Any

from app.contract.logprobs import clamped
from app.worker.engine import EngineOutput


def said_prompt_logprobs(request_output: Any) -> list[Any]:
    """The prompt's log probabilities of the engine's first output as vLLM's server gives them
    (``clamp_prompt_logprobs``: -inf as -9999.0), as a ``prompt_logprobs`` frame carries
    them: per prompt token None (the first) or [token id, logprob, rank, decoded text], in
    vLLM's order."""
    return [
        None
        if place is None
        else [[token_id, clamped(p.logprob), p.rank, p.decoded_token] for token_id, p in place.items()]
        for place in request_output.prompt_logprobs or ()
    ]


def saying_them(output: EngineOutput, unsaid: set[int], said: list[Any] | None) -> EngineOutput:
    """``output``, carrying the prompt's log probabilities if it is its choice's first token frame's
    (``unsaid``: the choices that have not had one; an output of no tokens and no text makes none)."""
    if unsaid and output.choice in unsaid and output.tool_call is None and (output.token_ids or output.text):
        unsaid.discard(output.choice)
        output.prompt_logprobs = said
    return output
