"""A pooling request's answer (docs/design.md §17): the replica's, whole.

It has no decode and no commit point before its answer: its completion is made durable,
then the answer is written as the replica gave it (JSON, or vLLM's bytes with their
``metadata`` header). Until then any failure may be retried (a retry's answer replaces
nothing: none was written). The answer's vectors are never logged; its usage is.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from app.driver.driver import RequestDriver
from app.driver.outputs import Cancelled, Failed, Finished, Output, PooledAnswer


class PooledResponse(JSONResponse):
    """The replica's answer as it came: its bytes, its media type, its own headers. (A
    ``JSONResponse``, as every whole answer the gateway's request loop hands back is.)"""

    def __init__(self, answer: PooledAnswer) -> None:
        super().__init__(answer.body, headers=answer.headers, media_type=answer.media_type)

    def render(self, content: Any) -> bytes:
        assert isinstance(content, bytes)
        return content


async def pooled_answer(driver: RequestDriver, output: Output) -> Output | JSONResponse:
    """The answer once the request completed in the log, or the failure that ended it."""
    while not isinstance(output, Finished):
        if isinstance(output, Failed | Cancelled):
            return output
        output = await anext(driver.outputs)  # a restart: the failed attempt sent nothing
    answer = output.answer
    if answer is None:  # a replica that answered with tokens: not a pooling answer
        raise RuntimeError(f"request {driver.request_id}: a pooling request finished without an answer")
    await driver.complete(output)
    return PooledResponse(answer)
