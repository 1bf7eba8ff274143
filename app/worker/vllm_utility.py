"""vLLM's utility routes on the worker's vLLM engine: ``/v1/tokenize``, ``/v1/detokenize``
and ``/v1/version``, answered as ``vllm serve`` answers ``/tokenize``, ``/detokenize`` and
``/version`` (the gateway relays them: app/api/utility.py).

The bodies are read with vLLM's own request models (``vllm.entrypoints.serve.tokenize``),
so the same fields are taken and the same defaults apply: a ``prompt`` is tokenized with
the special tokens added, ``messages`` are rendered by the chat template (with the
generation prompt, without special tokens). A chat is rendered by the same template call
as an attempt's prompt (app/worker/vllm_engine.py), so ``count`` is the prompt tokens an
attempt of those messages would have.
"""

from __future__ import annotations

from typing import Any

from app.worker.protocol import Code, Refusal


def tokenize(tokenizer: Any, max_model_len: int, body: dict[str, Any]) -> dict[str, Any]:
    from pydantic import ValidationError
    from vllm.entrypoints.serve.tokenize.protocol import (  # type: ignore[import-not-found, unused-ignore]
        TokenizeChatRequest,
        TokenizeCompletionRequest,
    )

    try:
        if "messages" in body:
            chat = TokenizeChatRequest.model_validate(body)
            tools = [tool.model_dump() for tool in chat.tools] if chat.tools else None
            text = tokenizer.apply_chat_template(
                body["messages"],
                tools=tools,
                add_generation_prompt=chat.add_generation_prompt,
                continue_final_message=chat.continue_final_message,
                tokenize=False,
                **(chat.chat_template_kwargs or {}),
            )
            ids = tokenizer.encode(text, add_special_tokens=chat.add_special_tokens)
            strs = chat.return_token_strs
        else:
            completion = TokenizeCompletionRequest.model_validate(body)
            ids = tokenizer.encode(completion.prompt, add_special_tokens=completion.add_special_tokens)
            strs = completion.return_token_strs
    except (ValidationError, ValueError) as exc:
        raise Refusal(400, Code.INVALID_FIELD, str(exc)) from None
    except Exception as exc:  # the chat template's own refusal (jinja's TemplateError)
        raise Refusal(400, Code.INVALID_FIELD, f"messages: the model's chat template refused them: {exc}") from None
    ids = list(ids)
    token_strs = tokenizer.convert_ids_to_tokens(ids) if strs else None
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
