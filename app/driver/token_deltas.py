"""A token frame as the client's delta (app/driver/loop.py hands them over): whether it
carries one at all, and the delta with the token ids the client asked for."""

from __future__ import annotations

from app.driver.outputs import Delta
from app.replicas.base import Token
from statemachine.deltas import NO_TEXT


def carries_delta(token: Token) -> bool:
    """Whether a token frame has anything for the client: text, log probabilities, or (a
    delta of no text field, :data:`NO_TEXT`) token ids the client asked for. One with none
    (a worker's frame of a tool call's markup tokens, sent as the decode's liveness) is
    read and counted, and sends nothing, as vLLM's server sends no delta for such tokens;
    it is no commit point either: nothing of the answer reached the client. A choice's
    first token that carries the prompt's log probabilities (a whole answer's) is a delta,
    text or not: the answer carries them."""
    return bool(token.text) or token.logprobs is not None or token.key == NO_TEXT or token.prompt_logprobs is not None


def delta_of(token: Token, with_ids: bool) -> Delta:
    """The client's delta of a token (one token when it names no token ids), with its token
    ids where the client asked for them (``with_ids``)."""
    tokens = token.tokens if token.tokens is not None else len(token.token_ids) or 1
    ids = token.token_ids if with_ids else ()
    return Delta(
        token.text,
        token.choice,
        tokens,
        token.logprobs,
        token.key,
        ids,
        token.prompt,
        token.prompt_tokens,
        token.prompt_logprobs,
    )
