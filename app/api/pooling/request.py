"""A pooling request's body (docs/design.md §17), checked against its route's declaration
(app/contract/pooling.py, which ``/openapi.json`` describes it by) and read into the request
the driver runs: no decode, its endpoint the route's path, its body passed on as the client
sent it (each attempt with its own model), and its prompt's tokens counted for the cost
guard (exact for token ids; else about four characters a token, as for a completion).
"""

from __future__ import annotations

import math
from typing import Any

from app.api.chat.request import as_refusal
from app.api.errors import InvalidRequest
from app.contract.declared import checked
from app.contract.pooling import ROUTES, SCORE_PAIRS
from app.driver.request import GenerationRequest, PoolingCall

CHARS_A_TOKEN = 4


def parse_pooling_request(path: str, body: Any) -> GenerationRequest:
    """The body of a request to the pooling route ``path``, validated. Raises
    :class:`InvalidRequest` naming the field it cannot take."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    with as_refusal():
        checked(ROUTES[path].model_validate, body)
    texts, token_ids = _prompt_parts(body)
    return GenerationRequest(
        endpoint=path,
        model=body["model"],
        stream=False,
        include_usage=False,
        prompt="\n".join(texts),
        user=body.get("user") if isinstance(body.get("user"), str) else None,
        raw=body,
        pooling=PoolingCall(prompt_tokens=token_ids + math.ceil(sum(len(text) for text in texts) / CHARS_A_TOKEN)),
    )


def _prompt_parts(body: dict[str, Any]) -> tuple[list[str], int]:
    """The texts a checked body asks to pool, and the token ids it gives as ids."""
    texts: list[str] = []
    ids = 0

    def take(value: Any) -> None:
        nonlocal ids
        if isinstance(value, str):
            texts.append(value)
        elif isinstance(value, int):
            ids += 1
        elif isinstance(value, list):
            for item in value:
                take(item)
        elif isinstance(value, dict):  # a chat message, or a score's content parts
            take(value.get("content"))
            if isinstance(value.get("text"), str):
                texts.append(value["text"])

    names = ["input", "messages", "texts", "inputs", "query", *(name for pair in SCORE_PAIRS for name in pair)]
    for name in dict.fromkeys(names):
        take(body.get(name))
    return texts, ids
