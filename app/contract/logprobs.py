"""Log probabilities of generated tokens: what a client may ask, and how they travel.

Asked as OpenAI (and vLLM) take them: chat ``logprobs: true`` with ``top_logprobs`` 0 to
20 alternatives; completions ``logprobs`` 0 to 5. Both sides reduce that to one number,
the alternatives wanted at each place (``None``: no log probabilities at all).

On the way from an engine to the client each generated token carries one
:data:`TokenLogprob`, as a worker's token frame holds it (``"logprobs": [[token,
logprob, [[alternative, logprob], …]], …]``, one per token of the frame): the token's
text, its log probability, and the most likely tokens at its place, best first. The
end-of-sequence token that stopped a choice has none, as vLLM's server gives none; an
echoed prompt's first token has a log probability of ``None`` and no alternatives (vLLM's
server gives ``null`` for both: nothing came before it). A token named otherwise than by its
text (``return_tokens_as_token_ids``: ``token_id:<id>``) carries its text fourth, where vLLM's
chat server gives the text's ``bytes`` for it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from app.contract.declared import BadInput

MAX_TOP_LOGPROBS = 20  # chat's top_logprobs, as OpenAI and vLLM's default max_logprobs
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions' logprobs, as OpenAI
LOWEST_LOGPROB = -9999.0  # what vLLM's server sends for -inf

TokenLogprob = (
    tuple[str, float | None, tuple[tuple[str, float], ...]]
    | tuple[str, float | None, tuple[tuple[str, float], ...], str]
)


def requested_logprobs(params: Mapping[str, Any], *, chat: bool | None, prefix: str = "") -> int | None:
    """How many alternatives a request wants at each token (``None``: no log probabilities).

    ``chat`` says which endpoint's form to accept: ``True`` the chat form, ``False`` the
    completions form, ``None`` either (the worker, which serves both)."""
    logprobs, top = params.get("logprobs"), params.get("top_logprobs")
    chat_form = isinstance(logprobs, bool) or (logprobs is None and top is not None)
    if chat is None:
        chat = chat_form
    if chat:
        if logprobs is not None and not isinstance(logprobs, bool):
            raise BadInput(prefix + "logprobs", "must be a boolean")
        if top is not None and (not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS):
            raise BadInput(prefix + "top_logprobs", f"must be an integer from 0 to {MAX_TOP_LOGPROBS}")
        if not logprobs:
            if top:
                raise BadInput(prefix + "top_logprobs", "needs logprobs set to true")
            return None
        return int(top or 0)
    if top is not None:
        raise BadInput(prefix + "top_logprobs", "is for chat; completions take logprobs as a number")
    if logprobs is None:
        return None
    if not _is_int(logprobs) or not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
        raise BadInput(prefix + "logprobs", f"must be an integer from 0 to {MAX_COMPLETION_LOGPROBS}")
    return int(logprobs)


def requested_prompt_logprobs(params: Mapping[str, Any], *, chat: bool, stream: bool) -> int | None:
    """The prompt's log probabilities an answer carries (vLLM's ``prompt_logprobs``: the
    alternatives at each prompt token, -1 every one the engine allows), read as vLLM's
    server reads them: as given, else for an ``echo`` chat's ``top_logprobs`` (0 when not
    given) or a completion's ``logprobs``. ``None``: none. A stream never carries them:
    vLLM refuses more than 0 there, naming the field, and shows none for 0."""
    given = params.get("prompt_logprobs")
    if given is not None:
        if not _is_int(given):  # (the declared model turned a whole float into an int)
            raise BadInput("prompt_logprobs", "must be an integer")
        if stream and (given > 0 or given == -1):
            raise BadInput("prompt_logprobs", "is not available when 'stream' is true: vLLM gives them whole")
        if given < -1:
            raise BadInput("prompt_logprobs", "must be a positive value or -1")
    if stream:
        return None
    if given is None and params.get("echo") is True:
        given = (params.get("top_logprobs") or 0) if chat else params.get("logprobs")
    return None if given is None else int(given)


def as_params(top: int | None, *, chat: bool) -> dict[str, Any]:
    """The request parameters that ask for ``top`` alternatives, in the endpoint's form."""
    if top is None:
        return {}
    return {"logprobs": True, "top_logprobs": top} if chat else {"logprobs": top}


def from_wire(value: Any) -> tuple[TokenLogprob, ...]:
    """A token frame's ``logprobs``, checked; raises ``ValueError`` when it is not one."""
    if not isinstance(value, list):
        raise ValueError("logprobs must be a list")
    return tuple(_entry(item) for item in value)


def _entry(item: Any) -> TokenLogprob:
    if not isinstance(item, list | tuple) or not 3 <= len(item) <= 4 or not isinstance(item[2], list | tuple):
        raise ValueError(f"not a [token, logprob, alternatives(, text)] entry: {item!r}")
    token, logprob, top = item[:3]
    if logprob is None and top:
        raise ValueError(f"a token with no log probability has no alternatives either: {item!r}")
    said = None if logprob is None else _logprob(logprob)
    entry = (_token(token), said, tuple((_token(t), _logprob(lp)) for t, lp in top))
    return entry if len(item) == 3 else (*entry, _token(item[3]))


def _token(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"a token must be a string, not {value!r}")
    return value


def _logprob(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value) or value > 0:
        raise ValueError(f"a log probability must be a number at most 0, not {value!r}")
    return clamped(value)


def chat_bytes(entry: TokenLogprob) -> list[int]:
    """A chat token's ``bytes``, as vLLM's server gives them: its text's (named otherwise, the
    text it carries fourth)."""
    return list((entry[3] if len(entry) == 4 else entry[0]).encode("utf-8", "replace"))


def named_text(token: str, said_bytes: Any) -> str | None:
    """The text a chat token carries fourth, from the ``bytes`` vLLM's server sent with it:
    ``None`` where they are its own (``bytes`` are UTF-8 that vLLM's server encoded)."""
    if type(said_bytes) is not list or said_bytes == list(token.encode("utf-8", "replace")):
        return None
    return bytes(said_bytes).decode("utf-8", "replace")


def clamped(logprob: float) -> float:
    """A log probability JSON can carry: -inf (a token the sampler ruled out) as vLLM sends it."""
    return max(float(logprob), LOWEST_LOGPROB)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
