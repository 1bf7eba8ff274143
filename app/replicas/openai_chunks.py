"""One ``data:`` line of an OpenAI-compatible upstream's stream, parsed, and the failure an
error object inside it means (app/replicas/openai_stream.py reads the stream).

vLLM streams what its engine finds wrong with a request once the stream began (its own
checks of the sampling parameters, a failure of its echo) as an error object carrying the
status it would have answered in ``code``: a client error there is the request's refusal,
which the client gets as that status, never the replica's fault (docs/design.md §13).
"""

from __future__ import annotations

from typing import Any

import orjson

from app.contract.refusal_codes import code_for
from app.replicas.base import UpstreamFailure
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
