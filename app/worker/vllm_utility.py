"""vLLM's utility routes on the worker's vLLM engine: ``/v1/tokenize``, ``/v1/detokenize``
and ``/v1/version``, answered as ``vllm serve`` answers ``/tokenize``, ``/detokenize`` and
``/version`` (the gateway relays them: app/api/utility/routes.py).

The bodies are read with vLLM's own request models (``vllm.entrypoints.serve.tokenize``),
so the same fields are taken and the same defaults apply, and rendered by vLLM's renderer
as an attempt's prompt is (app/worker/vllm_requests.py): a ``prompt`` is tokenized with
the special tokens added, ``messages`` are rendered by the chat template (with the
generation prompt, without special tokens), so ``count`` is the prompt tokens an attempt
of those messages would have.
"""

from __future__ import annotations

from typing import Any

from app.worker.protocol import Code, Refusal
from app.worker.vllm_requests import VllmRequests, token_ids, vllm_refusal


def tokenize(requests: VllmRequests, tokenizer: Any, max_model_len: int, body: dict[str, Any]) -> dict[str, Any]:
    from pydantic import ValidationError
    from vllm.entrypoints.serve.tokenize.protocol import (  # type: ignore[import-not-found, unused-ignore]
        TokenizeChatRequest,
        TokenizeCompletionRequest,
    )

    try:
        if "messages" in body:
            request = TokenizeChatRequest.model_validate(body)
            _, engine_input = requests.render_chat(request)
        else:
            request = TokenizeCompletionRequest.model_validate(body)
            engine_input = requests.render_prompt(request, request.prompt)
    except (ValidationError, ValueError) as exc:
        raise Refusal(400, Code.INVALID_FIELD, str(exc)) from None
    except Exception as exc:  # vLLM's own checks (its validation errors, the chat template's refusal)
        raise vllm_refusal(exc) from None
    ids = token_ids(engine_input)
    token_strs = tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": token_strs}


def detokenize(tokenizer: Any, body: dict[str, Any]) -> dict[str, Any]:
    from pydantic import ValidationError
    from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest  # type: ignore[import-not-found, unused-ignore]

    try:
        request = DetokenizeRequest.model_validate(body)
    except (ValidationError, ValueError) as exc:
        raise Refusal(400, Code.INVALID_FIELD, str(exc)) from None
    if any(token >= len(tokenizer) for token in request.tokens):
        raise Refusal(400, Code.INVALID_FIELD, f"a token id is not below the vocabulary's size ({len(tokenizer)})")
    return {"prompt": tokenizer.decode(request.tokens)}


def version() -> dict[str, Any]:
    from vllm import __version__  # type: ignore[import-not-found, unused-ignore]

    return {"version": __version__}
