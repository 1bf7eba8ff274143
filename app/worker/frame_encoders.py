"""The frames the worker writes: one JSON object per line (docs/worker-protocol.md).

The token frame is on every token's path, so it is built by hand from ``json.dumps`` of
its two free-form parts, not from a dict.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from typing import Any

from app.worker.engine import PooledOutput
from app.worker.protocol import Code

_dumps = json.dumps


def heartbeat_frame(phase: str, queue_position: int | None) -> bytes:
    return b'{"type":"heartbeat","phase":"%s","queue_position":%s}\n' % (
        phase.encode(),
        b"null" if queue_position is None else str(queue_position).encode(),
    )


def token_frame(
    choice: int,
    index: int,
    text: str,
    token_ids: list[int] | tuple[int, ...],
    logprobs: list[Any] | None = None,
    key: str | None = None,
    prompt: tuple[list[int] | None, str | None] | None = None,
) -> bytes:
    """A token frame; ``logprobs`` (asked for: app/contract/logprobs.py) one entry per token id;
    ``key`` the delta field of a text that is not the content (``reasoning``); ``prompt``,
    with a choice's first delta where asked, the prompt's token ids and rendered text."""
    frame = b'{"type":"token","choice":%d,"index":%d,"text":%s,"token_ids":[%s]' % (
        choice,
        index,
        _dumps(text).encode(),
        ",".join(map(str, token_ids)).encode(),
    )
    if logprobs is not None:
        frame += b',"logprobs":%s' % _dumps(logprobs).encode()
    if key is not None:
        frame += b',"key":%s' % _dumps(key).encode()
    if prompt is not None:
        frame += b',"prompt_token_ids":%s,"prompt_text":%s' % (_dumps(prompt[0]).encode(), _dumps(prompt[1]).encode())
    return frame + b"}\n"


def with_prompt_tokens(frame: bytes, prompt_tokens: int) -> bytes:
    """A token frame (``token_frame``'s) that also says the prompt's token count, as a
    choice's first text does where the client asked for the usage in every chunk."""
    return frame[:-2] + b',"prompt_tokens":%d}\n' % prompt_tokens


def prompt_logprobs_frame(choice: int, said: Sequence[Any]) -> bytes:
    """The prompt's log probabilities of ``choice``, before its first token frame, where the
    start asked (``prompt_logprobs``): per prompt token null (the first) or a list of
    [token id, logprob, rank, decoded text], in vLLM's order."""
    return b'{"type":"prompt_logprobs","choice":%d,"logprobs":%s}\n' % (choice, _dumps(said).encode())


def tool_call_frame(
    choice: int, index: int, tool_call_id: str, name: str, arguments: str, *, streamed: bool = False
) -> bytes:
    """A whole tool call; ``streamed``: its pieces went out before it (token frames under
    ``tool_calls``), so it is for the gateway's tool ledger only."""
    frame: dict[str, Any] = {
        "type": "tool_call",
        "choice": choice,
        "index": index,
        "id": tool_call_id,
        "name": name,
        "arguments": arguments,
    }
    if streamed:
        frame["streamed"] = True
    return _dumps(frame).encode() + b"\n"


def done_frame(
    finish_reasons: list[str],
    usage: Mapping[str, Any],
    stop_reasons: Sequence[str | int | None] = (),
    answer: PooledOutput | None = None,
) -> bytes:
    """The done frame; a pooling request's carries its answer (``answer``: ``json``, its
    JSON value, or ``bytes``, base64; with its ``headers``)."""
    frame: dict[str, Any] = {
        "type": "done",
        "finish_reason": finish_reasons[0],
        "finish_reasons": finish_reasons,
        "usage": dict(usage),
    }
    if answer is not None:
        value = answer.value
        said = {"bytes": base64.b64encode(value).decode()} if isinstance(value, bytes) else {"json": value}
        frame["answer"] = said | {"headers": answer.headers}
    if any(stop is not None for stop in stop_reasons):  # the stop string or token id, per choice
        frame["stop_reasons"] = list(stop_reasons)
    return _dumps(frame).encode() + b"\n"


def error_frame(code: Code, message: str, generated_tokens: int) -> bytes:
    frame = {"type": "error", "code": code.value, "message": message, "generated_tokens": generated_tokens}
    return _dumps(frame).encode() + b"\n"
