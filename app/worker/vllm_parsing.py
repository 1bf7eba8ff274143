"""vLLM's own output parsers in the worker: reasoning and tool calls split out of the
engine's text as ``vllm serve`` splits them (docs/design.md §14).

``phasegate worker --engine vllm`` takes ``--reasoning-parser``, ``--tool-call-parser`` and
``--enable-auto-tool-choice`` as ``vllm serve`` does. With them, each attempt of a chat
request gets one of vLLM's ``Parser`` objects per choice (``vllm.parser``: the class
``ParserManager.get_parser`` composes for those names), built from the attempt's vLLM
``ChatCompletionRequest``:

- once vLLM's renderer rendered the request (app/worker/vllm_requests.py), the parser
  adjusts it as vLLM's server does: a ``required`` or named ``tool_choice`` becomes the
  structured output (a structural tag) that forces the call, which the request's sampling
  parameters then carry;
- each engine output goes through ``parse_delta``: its text comes back as content,
  reasoning or pieces of tool calls. Each becomes a token frame under its field's name (a
  tool call's piece: under ``tool_calls``, its JSON as vLLM's server streams it); a tool
  call's pieces are also gathered, and the whole call is published for the gateway's tool
  ledger once its choice has finished.
  A choice that called a tool by ``auto`` or ``required`` finishes as ``tool_calls``, as
  vLLM's server says; a named call keeps the engine's reason (``stop``). With
  ``parallel_tool_calls`` false only a choice's first call is sent and taken, as vLLM's
  server filters them.

Without parsers, tools only reach the chat template and a tool choice that needs a parser
is refused as vLLM's server refuses it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from app.worker.engine import EngineOutput, ToolCallOutput
from app.worker.protocol import AttemptSpec, Code, Refusal

REASONING = "reasoning"  # the delta field vLLM 0.32's server puts reasoning under
TOOL_CALLS = "tool_calls"  # the delta field of a tool call's pieces


@dataclass(frozen=True, slots=True)
class ParserNames:
    """The parsers a worker runs, by ``vllm serve``'s names (None: none)."""

    reasoning: str | None = None
    tool_call: str | None = None
    auto_tool_choice: bool = False


class Parsers:
    """The parser class for a worker's names, and the per-attempt parsing built from it."""

    def __init__(self, names: ParserNames, tokenizer: Any, model: str) -> None:
        from vllm.parser import ParserManager  # type: ignore[import-not-found, unused-ignore]

        self.names = names
        self.tokenizer = tokenizer
        self.parser_cls = ParserManager.get_parser(
            tool_parser_name=names.tool_call,
            reasoning_parser_name=names.reasoning,
            enable_auto_tools=names.auto_tool_choice,
            model_name=model,
            tokenizer=tokenizer,
        )

    def for_attempt(self, spec: AttemptSpec) -> AttemptParsing | None:
        """The parsing of one chat attempt; None when there is nothing to parse."""
        s = spec.sampling
        choice = s.tool_choice
        if s.tools and choice not in (None, "none") and self.names.tool_call is None:  # vLLM's words
            if choice == "auto":  # (--enable-auto-tool-choice needs a tool parser: app/worker/config.py)
                why = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
            else:
                named = f'function "{choice["function"]["name"]}"' if isinstance(choice, dict) else f'"{choice}"'
                why = f"tool_choice={named} requires --tool-call-parser to be set"
            raise Refusal(400, Code.BAD_REQUEST, why)  # as vLLM's server: no param
        if self.parser_cls is None or spec.messages is None:
            return None
        return AttemptParsing(self, spec)


class AttemptParsing:
    """vLLM's parsers over one attempt's outputs: one parser a choice, and the request
    they read (tools, tool choice), adjusted as vLLM's server adjusts it."""

    def __init__(self, parsers: Parsers, spec: AttemptSpec) -> None:
        self._parsers_of = parsers
        self._choices = spec.sampling.n
        self._named = isinstance(spec.sampling.tool_choice, dict)
        self._calls: list[dict[int, list[str]]] = [{} for _ in range(self._choices)]
        self._generated: list[list[int]] = [[] for _ in range(self._choices)]
        self._held: list[list[int]] = [[] for _ in range(self._choices)]
        self._parsers: list[Any] = []
        self._reasons = False
        self.request: Any = None
        self.prompt_token_ids: list[int] = []

    def adjust(self, request: Any) -> Any:
        """vLLM's ``ChatCompletionRequest`` of the attempt, rendered, as the parsers adjust it:
        a ``required`` or named ``tool_choice`` becomes the structured output that forces the
        call (app/worker/vllm_requests.py reads it from the adjusted request)."""
        parsers = self._parsers_of
        parser_cls: Any = parsers.parser_cls
        self._parsers = [parser_cls(parsers.tokenizer, request.tools, model_config=None) for _ in range(self._choices)]
        self.request = self._parsers[0].adjust_request(request)
        self._reasons = self._parsers[0].reasoning_parser is not None
        return self.request

    def engine_kwargs(self, prompt_token_ids: list[int]) -> dict[str, Any]:
        """What vLLM's server gives the engine beside the prompt: whether the reasoning has
        ended already (the prompt closed it, or there is none), so that a structured output
        (a forced tool call's) constrains only the answer after it."""
        self.prompt_token_ids = prompt_token_ids
        reasoning_ended = self.request.resolve_reasoning_ended(self._parsers[0], prompt_token_ids)
        return {
            "reasoning_ended": reasoning_ended,
            "reasoning_parser_kwargs": {"chat_template_kwargs": {}} if self._reasons else None,
        }

    def usage_details(self) -> dict[str, Any] | None:
        """vLLM's ``completion_tokens_details`` when a reasoning parser runs: its count of
        reasoning tokens over the choices."""
        if not self._reasons:
            return None
        counted = sum(p.count_reasoning_tokens(ids) for p, ids in zip(self._parsers, self._generated, strict=True))
        return {"completion_tokens_details": {"reasoning_tokens": counted}}

    def _allowed(self, calls: Any) -> Any:
        """A delta's tool-call pieces as vLLM's server sends them: with ``parallel_tool_calls``
        false, only the first call's (``maybe_filter_parallel_tool_calls``)."""
        if self.request.parallel_tool_calls is False:
            return [call for call in calls if call.index == 0]
        return calls

    def outputs(
        self,
        choice: int,
        token_ids: list[int],
        text: str,
        finish_reason: str | None,
        logprobs: list[Any] | None,
        stop_reason: str | int | None = None,
    ) -> list[EngineOutput]:
        """What one engine output of ``choice`` publishes: its reasoning and content (the
        token ids and log probabilities with the first), and, once the choice finished, its
        tool calls whole, then the finish."""
        self._generated[choice] += token_ids
        delta = self._parsers[choice].parse_delta(
            text, token_ids, self.request, self.prompt_token_ids, finished=finish_reason is not None
        )
        pieces: list[EngineOutput] = []
        if delta is not None:
            for key, piece in ((REASONING, delta.reasoning), (None, delta.content)):
                if piece:
                    pieces.append(EngineOutput(choice, [], piece, key=key))
            for call in self._allowed(delta.tool_calls or ()):  # as vLLM's server sends it, gathered for the ledger
                pieces.append(
                    EngineOutput(choice, [], json.dumps([call.model_dump(exclude_unset=True)]), key=TOOL_CALLS)
                )
                gathered = self._calls[choice].setdefault(call.index, ["", "", ""])
                function = call.function
                gathered[0] = call.id or gathered[0]
                gathered[1] += (function.name or "") if function is not None else ""
                gathered[2] += (function.arguments or "") if function is not None else ""
        # an output the parser turned into no text (the think block's end) waits for the
        # next piece, as vLLM's server sends no delta for it; one more such output (a tool
        # call's markup and arguments) goes out with it in a frame of no text, since frames
        # are the decode's liveness; with log probabilities asked for, vLLM sends them in a
        # delta of no text, and so does this
        held = self._held[choice]
        if pieces:  # the output's tokens, counted once, with the first piece
            pieces[0].token_ids, pieces[0].logprobs = held + token_ids, logprobs
            held.clear()
        elif logprobs is not None or held:
            pieces.append(EngineOutput(choice, held + token_ids, "", logprobs=logprobs))
            held.clear()
        else:
            held += token_ids
        if finish_reason is None:
            return pieces
        calls = self._calls[choice]
        for index in sorted(calls):
            call_id, name, arguments = calls[index]
            call = ToolCallOutput(index, call_id, name, arguments, streamed=True)
            pieces.append(EngineOutput(choice, held[:], "", tool_call=call))  # the call's tokens with it
            held.clear()
        if held:  # the answer ended on tokens of no text: counted in a last frame of none
            pieces.append(EngineOutput(choice, held[:], ""))
            held.clear()
        if calls and not self._named and finish_reason == "stop":
            finish_reason = "tool_calls"
        pieces.append(EngineOutput(choice, [], "", finish_reason, stop_reason=stop_reason))
        return pieces
