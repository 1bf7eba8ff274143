"""The stable code a client gets for vLLM's refusal of a request (docs/design.md §14).

vLLM's server answers a request it refuses with a status and a message and no code of its
own that a client can rely on. phasegate gives the client one code for one refusal,
whichever replica kind served the attempt: an ``openai`` replica's answer is read by
:func:`code_for` (app/replicas/openai_upstream.py), and a ``phasegate worker --engine
vllm`` runs vLLM's own request checks and names its refusals by the same function
(app/worker/vllm_requests.py). A context-length refusal is ``context_length_exceeded``
on both paths: the policy's context-window fallbacks act on that code.
"""

from __future__ import annotations

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
BAD_REQUEST = "upstream_bad_request"  # vLLM refused the request's values: its message says which


def code_for(status: int, message: str) -> str:
    """The code of a refusal with ``status`` whose message is vLLM's ``message``."""
    if "maximum context length" in message or "context length" in message:
        return CONTEXT_LENGTH_EXCEEDED
    return {400: BAD_REQUEST, 404: "model_not_found", 413: "request_too_large"}.get(status, "upstream_refused_request")


def context_length_message(max_model_len: int, prompt_tokens: int) -> str:
    """vLLM 0.32's words for a prompt that leaves no room for output (its renderer's
    ``_token_len_check``), for an engine without vLLM's renderer (the sim)."""
    return (
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains"
        f" {prompt_tokens} input tokens, which exceeds this limit even without any output tokens."
        " Please reduce the length of the input prompt."
    )
