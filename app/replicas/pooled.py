"""A pooling request's attempt (docs/design.md §17): one whole answer, no tokens.

A pooling request has no decode: its attempt is a request and its answer, which comes as
one :class:`~app.replicas.base.Done` frame carrying the answer as the replica gave it
(:class:`~app.replicas.base.PooledAnswer`: a JSON body, or vLLM's bytes with their
``metadata`` header). Its usage is read from it for the log (the prompt's tokens; the
vectors are never read into the log). Reading the body is the frame's wait, so the
driver's first-token deadline bounds it, and a replica that dies while it answers breaks
the read (``replica_exited``): nothing reached the client, so it is retried.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson

from app.replicas.base import Done, Frame, PooledAnswer, UpstreamFailure, usage_of
from statemachine.events import FailureKind

POOLED_FINISH = "stop"  # the finish the log records for a pooling request's answer
# the answer's headers passed on to the client: vLLM's description of a bytes answer
KEPT_HEADERS = ("metadata",)


def is_pooling(endpoint: str) -> bool:
    """A pooling route's endpoint is its path (``/v1/embeddings`` …); a generation's a name."""
    return endpoint.startswith("/")


def pooled_usage(answer: PooledAnswer) -> tuple[dict[str, int], dict[str, Any] | None]:
    """The usage an answer states: OpenAI's ``usage`` (embeddings, pooling, classify, score,
    rerank), Cohere's ``meta.billed_units`` (``/v2/embed``), or a bytes answer's ``metadata``
    header's; empty when it states none."""
    said: Any = None
    try:
        if answer.media_type.startswith("application/json"):
            said = orjson.loads(answer.body)
        elif "metadata" in answer.headers:
            said = orjson.loads(answer.headers["metadata"])
    except ValueError:
        return {}, None
    if not isinstance(said, dict):
        return {}, None
    usage = said.get("usage")
    if not isinstance(usage, dict):
        billed = (said.get("meta") or {}).get("billed_units") if isinstance(said.get("meta"), dict) else None
        tokens = billed.get("input_tokens") if isinstance(billed, dict) else None
        usage = {"prompt_tokens": tokens, "total_tokens": tokens} if type(tokens) is int else {}
    return usage_of(usage)


def pooled_done(answer: PooledAnswer) -> Done:
    """The attempt's one frame: its answer, with the usage it states."""
    usage, details = pooled_usage(answer)
    return Done(POOLED_FINISH, [POOLED_FINISH], usage=usage, usage_details=details, answer=answer)


class PooledStream:
    """An OpenAI-compatible server's answer to a pooling request, read whole."""

    unstreamed = False  # its answer came before the stream was made (its start waited for it)

    def __init__(self, response: httpx.Response) -> None:
        self._response = response

    async def frames(self) -> AsyncIterator[Frame]:
        response = self._response
        try:
            body = await response.aread()
        except httpx.HTTPError as exc:
            raise UpstreamFailure(FailureKind.REPLICA_EXITED, f"the answer broke off: {exc!r}") from None
        media_type = response.headers.get("content-type", "application/json")
        headers = {name: response.headers[name] for name in KEPT_HEADERS if name in response.headers}
        yield pooled_done(PooledAnswer(body, media_type, headers))

    async def close(self) -> None:
        await self._response.aclose()
