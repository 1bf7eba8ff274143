"""One ``data:`` line of an OpenAI-compatible upstream's stream, parsed, the failure an
error object inside it means, and what its choices carry read out of it: their texts in
the order generated, tool calls, log probabilities, token ids and what is said of the
prompt (app/replicas/openai_stream.py reads the stream).

vLLM streams what its engine finds wrong with a request once the stream began (its own
checks of the sampling parameters, a failure of its echo) as an error object carrying the
status it would have answered in ``code``: a client error there is the request's refusal,
which the client gets as that status, never the replica's fault (docs/design.md §13).
"""

from __future__ import annotations

from typing import Any

import orjson

from app.contract.logprobs import TokenLogprob, from_wire, named_text
from app.contract.refusal_codes import code_for
from app.replicas.base import UpstreamFailure, tool_call_piece_problem
from statemachine.deltas import CONTENT, NO_TEXT, REASONING_FIELDS, Prompt
from statemachine.events import FailureKind

_NO_CHOICES: list[Any] = []  # never changed: what a chunk without choices is checked as


def parse_chunk(data: bytes | str) -> dict[str, Any]:
    try:
        # orjson, not json: it refuses what is not Unicode text (a lone UTF-16 surrogate
        # escape), which could neither be sent on as UTF-8 nor recorded, and NaN
        chunk = orjson.loads(data)
    except ValueError as exc:
        if isinstance(data, bytes):  # as text, as it was read before: bytes not UTF-8 replaced
            return parse_chunk(data.decode("utf-8", "replace"))
        raise UpstreamFailure(FailureKind.LIVENESS_UNCERTAIN, f"malformed chunk ({exc}): {data[:80]!r}") from None
    if type(chunk) is not dict or type(chunk.get("choices", _NO_CHOICES)) is not list:  # orjson's own types
        raise UpstreamFailure(FailureKind.LIVENESS_UNCERTAIN, f"malformed chunk: {data[:80]!r}")
    if "error" in chunk:
        raise _error_in_stream(chunk["error"])
    return chunk


def _error_in_stream(error: Any) -> UpstreamFailure:
    """An error object in the stream: vLLM streams what its engine finds wrong with a request
    whose stream began with the status it would have answered (``code``: 400), the client's
    refusal, never the replica's fault (docs/design.md §13); any other is the replica's."""
    error = error if isinstance(error, dict) else {"message": error}
    message, status, param = str(error.get("message")), error.get("code"), error.get("param")
    if type(status) is int and 400 <= status < 500 and status not in (408, 429):
        param = param if isinstance(param, str) else None
        return UpstreamFailure(
            FailureKind.REQUEST_REFUSED, message, status=status, code=code_for(status, message), param=param
        )
    return UpstreamFailure(FailureKind.REPLICA_EXITED, f"upstream error mid-stream: {message}")


def chunk_logprobs(given: Any) -> tuple[TokenLogprob, ...] | None:
    """A chunk's log probabilities (chat's ``content`` list, or the completions' columns)."""
    if given is None:
        return None
    try:
        if "content" in given:  # chat (a token named otherwise than its text: its text fourth)
            entries = [
                [e["token"], e["logprob"], [[t["token"], t["logprob"]] for t in e.get("top_logprobs") or ()]]
                + ([] if (text := named_text(e["token"], e.get("bytes"))) is None else [text])
                for e in given["content"] or ()
            ]
        else:  # completions: tokens, token_logprobs, top_logprobs (one {token: logprob} a token)
            tops = given.get("top_logprobs") or [None] * len(given["tokens"])
            entries = [
                [token, logprob, [[t, lp] for t, lp in (top or {}).items()]]
                for token, logprob, top in zip(given["tokens"], given["token_logprobs"], tops, strict=True)
            ]
        return from_wire(entries)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UpstreamFailure(FailureKind.LIVENESS_UNCERTAIN, f"malformed logprobs in a chunk: {exc!r}") from None


def chunk_token_ids(given: Any) -> tuple[int, ...]:
    """A chunk's token ids (vLLM's ``return_token_ids``): none where it sent none."""
    if given is None:
        return ()
    if type(given) is not list or not all(type(n) is int for n in given):
        raise UpstreamFailure(FailureKind.LIVENESS_UNCERTAIN, f"malformed token ids in a chunk: {given!r:.80}")
    return tuple(given)


def prompt_of(chunk: dict[str, Any], choice: dict[str, Any]) -> Prompt | None:
    """What a chunk says of a choice's prompt: its token ids (a chat chunk's own, a
    completion choice's) and its rendered text (``return_prompt_text``); None if nothing."""
    token_ids = choice.get("prompt_token_ids", chunk.get("prompt_token_ids"))
    text = chunk.get("prompt_text")
    if token_ids is None and text is None:
        return None
    if text is not None and type(text) is not str:
        raise UpstreamFailure(FailureKind.LIVENESS_UNCERTAIN, f"malformed prompt_text in a chunk: {text!r:.80}")
    return (None if token_ids is None else chunk_token_ids(token_ids)), text


def delta_pieces(delta: dict[str, Any]) -> list[tuple[str, str]]:
    """A chat delta's texts with their keys, in the order generated: reasoning before the
    content that follows it in one chunk, and any other text field vLLM sends, as it is."""
    pieces = [(key, value) for key, value in delta.items() if type(value) is str and value and key != "role"]
    if len(pieces) > 1:
        pieces.sort(key=lambda piece: (piece[0] == CONTENT, piece[0] not in REASONING_FIELDS))
    return pieces


def tool_call_piece(calls: Any) -> str:
    """A chat delta's ``tool_calls`` as the client's delta carries them (their JSON)."""
    problem = tool_call_piece_problem(calls)
    if problem is not None:
        raise UpstreamFailure(FailureKind.LIVENESS_UNCERTAIN, problem)
    return orjson.dumps(calls).decode()


def key_of_no_text(delta: dict[str, Any]) -> str:
    """Where a chat delta with no text put its token: the field it sent empty, or none
    (:data:`NO_TEXT`: vLLM's ``delta: {}`` for the token that ends the think block)."""
    return next((key for key, value in delta.items() if type(value) is str and key != "role"), NO_TEXT)


def completion_text(choice: dict[str, Any]) -> list[tuple[str, str]]:
    text = choice.get("text")
    return [(CONTENT, text)] if type(text) is str and text else []
