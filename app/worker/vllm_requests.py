"""A start request read, rendered and limited by vLLM's own code, as ``vllm serve`` reads,
renders and limits the same request (docs/design.md §14): the same prompt tokens, the same
sampling defaults, the same refusals through a worker as through vLLM's server.

- The request's fields are the start request's ``vllm`` object: the client's fields as the
  gateway passed them on (docs/worker-protocol.md). A start request without one (curl,
  the health probe) stands for them with its ``params``, which use the same names.
- They are read by vLLM's request model (``ChatCompletionRequest``, ``CompletionRequest``)
  with the attempt's model and messages or prompt, streamed.
- A chat request is rendered by vLLM's renderer with the chat template's arguments as
  vLLM's ``OnlineRenderer`` gives them (tools, ``chat_template_kwargs``,
  ``add_generation_prompt``, ``continue_final_message``, ``documents``, ``reasoning_effort``),
  and tokenized with the request's limits (``max_tokens`` against the context, truncation);
  a completion's prompt by its ``render_cmpl``. vLLM's parsers then adjust the request
  (a forced tool call's structured output: app/worker/vllm_parsing.py).
- ``max_tokens`` is vLLM's ``get_max_tokens`` and the sampling parameters the request's own
  ``to_sampling_params`` (``to_beam_search_params`` for ``use_beam_search``), over the
  model's generation config as defaults.
- What vLLM refuses is refused with vLLM's status, message and ``param``; its code is the
  one a client gets for the same refusal through an ``openai`` replica
  (app/contract/refusal_codes.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from app.contract.refusal_codes import code_for
from app.worker.protocol import AttemptSpec, Code, Refusal


@dataclass(slots=True)
class VllmRequest:
    """What vLLM's server makes of one attempt's request: its request model (adjusted by
    the parsers, for chat), the engine's input and the prompt's token ids, and the text
    it sends before the answer (a chat request's ``echo``)."""

    request: Any
    engine_input: Any
    prompt_token_ids: list[int]
    echo: str = ""

    def prompt_said(self) -> tuple[list[int] | None, str | None] | None:
        """What vLLM's server says of the prompt before each choice's first delta, where
        the client asked: its token ids (``return_token_ids``) and the rendered prompt
        (``return_prompt_text``); None when neither."""
        echoed = self.echo and not hasattr(self.request, "messages")  # a completion's echo names them too
        ids = self.prompt_token_ids if echoed or getattr(self.request, "return_token_ids", None) else None
        text = self.engine_input.get("prompt") if getattr(self.request, "return_prompt_text", None) else None
        return None if ids is None and text is None else (ids, text)


class VllmRequests:
    """vLLM's request handling over one engine (an ``AsyncLLM``'s renderer and model config)."""

    def __init__(self, llm: Any, chat_template: str | None = None, tasks: tuple[str, ...] = ("generate",)) -> None:
        from vllm.renderers.chat_utils import load_chat_template  # type: ignore[import-not-found, unused-ignore]

        self._renderer = llm.renderer
        self._input_processor, self._tasks = llm.input_processor, tasks  # the engine's tasks (``generate``)
        self._model_config = llm.model_config
        self._chat_template = load_chat_template(chat_template)  # None: the tokenizer's own
        # the model's generation config, which vLLM's server applies under the client's fields
        self._defaults: dict[str, Any] = self._model_config.get_diff_sampling_param()
        override = getattr(self._model_config, "override_generation_config", None) or {}
        if self._model_config.generation_config not in ("auto", "vllm"):
            self._override_max_tokens = self._defaults.get("max_tokens")
        else:
            self._override_max_tokens = override.get("max_new_tokens")

    def read(self, spec: AttemptSpec, adjust: Callable[[Any], Any] | None = None) -> VllmRequest:
        """The attempt's request read and rendered by vLLM; ``adjust``: the parsers' own
        adjustment of a chat request, made after rendering as vLLM's server makes it."""
        fields = dict(spec.fields)
        try:
            if spec.messages is not None:
                return self._chat(spec, fields, adjust)
            return self._completion(spec, fields)
        except Refusal:
            raise
        except Exception as exc:  # vLLM's request checks: its validation errors, ValueError, jinja's
            raise vllm_refusal(exc) from None

    def sampling_params(self, read: VllmRequest) -> Any:
        """vLLM's sampling parameters for the request, its ``max_tokens`` as vLLM's server sets it."""
        from vllm.entrypoints.serve.utils.api_utils import get_max_tokens  # type: ignore[import-not-found, unused-ignore]

        request = read.request
        asked = getattr(request, "max_completion_tokens", None)
        try:
            max_tokens = get_max_tokens(
                self._model_config.max_model_len,
                asked if asked is not None else request.max_tokens,
                len(read.prompt_token_ids),
                self._defaults,
                self._override_max_tokens,
                truncate_prompt_tokens=request.truncate_prompt_tokens,
            )
            if request.use_beam_search:  # run as vLLM's server runs it (app/worker/vllm_beams.py)
                return request.to_beam_search_params(max_tokens, self._defaults)
            params = request.to_sampling_params(max_tokens, self._defaults)
            # the engine's own checks of the parameters (``thinking_token_budget`` without a
            # reasoning configuration), which vLLM's server answers 400 as its stream begins:
            # here, before the attempt's stream, so that they refuse it as the client's
            self._input_processor._validate_params(params.clone(), self._tasks)
            return params
        except Exception as exc:
            raise vllm_refusal(exc) from None

    def render_chat(self, request: Any) -> tuple[list[dict[str, Any]], Any]:
        """The conversation and the engine's input of a chat request of vLLM's (an attempt's, or ``/tokenize``'s),
        as vLLM's ``OnlineRenderer.preprocess_chat`` renders it: the chat template (the
        worker's ``--chat-template``, else the tokenizer's) with the request's tools and
        arguments, tokenized with the request's limits."""
        tools = None if request.tools is None else [tool.model_dump() for tool in request.tools]
        chat_params = request.build_chat_params(self._chat_template, "auto").with_defaults(
            {"tools": tools, "tokenize": False}
        )
        tok_params = request.build_tok_params(self._model_config)
        (conversation,), (engine_input,) = self._renderer.render_chat([request.messages], chat_params, tok_params)
        return conversation, engine_input

    def render_prompt(self, request: Any, prompt: str | list[int]) -> Any:
        """The engine's input for a completion's prompt (text or token ids) of a request of vLLM's."""
        from vllm.renderers.inputs.preprocess import parse_model_prompt  # type: ignore[import-not-found, unused-ignore]

        given = {"prompt_token_ids": prompt} if isinstance(prompt, list) else prompt
        (engine_input,) = self._renderer.render_cmpl(
            [parse_model_prompt(self._model_config, given)], request.build_tok_params(self._model_config)
        )
        return engine_input

    def _chat(self, spec: AttemptSpec, fields: dict[str, Any], adjust: Callable[[Any], Any] | None) -> VllmRequest:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest  # type: ignore[import-not-found, unused-ignore]

        request = ChatCompletionRequest.model_validate(
            {**fields, "model": spec.model, "messages": list(spec.messages or ()), "stream": True}
        )
        conversation, engine_input = self.render_chat(request)
        if adjust is not None:
            request = adjust(request)
        return VllmRequest(request, engine_input, token_ids(engine_input), echoed(request, conversation))

    def _completion(self, spec: AttemptSpec, fields: dict[str, Any]) -> VllmRequest:
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest  # type: ignore[import-not-found, unused-ignore]

        prompt = list(spec.prompt) if isinstance(spec.prompt, tuple) else spec.prompt
        request = CompletionRequest.model_validate({**fields, "model": spec.model, "prompt": prompt, "stream": True})
        if request.suffix is not None:
            raise Refusal(400, Code.UNSUPPORTED_FIELD, "suffix: the worker does not render FIM prompts", field="suffix")
        assert prompt is not None
        engine_input = self.render_prompt(request, prompt)
        # a completion's echo is its prompt's text before the answer (none where the client
        # asked for token ids: they name the prompt's instead, as vLLM's server sends them)
        echo = "" if not request.echo or request.return_token_ids else engine_input.get("prompt") or ""
        return VllmRequest(request, engine_input, token_ids(engine_input), echo)


def token_ids(engine_input: Any) -> list[int]:
    return list(engine_input.get("prompt_token_ids") or ())


def vllm_refusal(exc: Exception) -> Refusal:
    """vLLM's refusal of a request, as its server words it (status, message, ``param``)."""
    from pydantic import ValidationError
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response  # type: ignore[import-not-found, unused-ignore]

    if isinstance(exc, ValidationError):  # vLLM's server answers these 400, naming the field
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or None
        message = f"{field}: {first['msg']}" if field else str(first["msg"])
        return Refusal(400, Code.BAD_REQUEST, message, field=field)
    error = create_error_response(exc).error
    status = int(error.code)
    if status >= 500:  # not the request's fault: the worker's own internal error
        raise exc
    return Refusal(status, Code(code_for(status, error.message)), error.message, field=error.param)


def echoed(request: Any, conversation: list[dict[str, Any]]) -> str:
    """What vLLM's server sends before a chat answer when asked to ``echo``: the last
    message's content, when that message is in the answer's role (the assistant's, or,
    without a generation prompt, the last message's own: a continued message)."""
    if not request.echo or not conversation:
        return ""
    role = "assistant" if request.add_generation_prompt else request.messages[-1]["role"]
    last = conversation[-1]
    if last.get("role") != role:
        return ""
    content = last.get("content") or ""
    return content if isinstance(content, str) else "\n".join(part["text"] for part in content)
