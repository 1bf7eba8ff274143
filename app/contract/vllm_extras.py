"""vLLM's extra sampling parameters, as ``vllm serve`` takes them, declared: one rule for both sides.

The gateway's request models (app/contract/requests.py) declare these fields, and the
worker (app/worker/protocol.py) checks the same declarations; both pass the values on
under the names the installed vLLM reads (0.32: ``structured_outputs`` on its OpenAI
server, ``SamplingParams`` in process):

- ``top_k`` (-1 or 0: off, else at least 1), ``min_p`` ([0, 1]), ``repetition_penalty``
  (greater than 0), ``min_tokens`` (0 up to ``max_tokens``);
- structured outputs: ``structured_outputs`` with exactly one of ``json`` (a schema: an
  object, or a string holding one), ``regex``, ``choice`` (strings), ``grammar`` or
  ``json_object: true``. The older guided-decoding fields (``guided_json``,
  ``guided_regex``, ``guided_choice``, ``guided_grammar``), which vLLM 0.32 ignores without
  a word, are taken as the same constraint, so a client written for them still gets
  constrained output rather than free text.

A failed check raises :class:`~app.contract.declared.BadInput` naming the parameter.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, ConfigDict, Field, TypeAdapter, model_validator

from app.contract.declared import BadInput, Declared, checked, says

SAMPLING_EXTRAS = ("top_k", "min_p", "repetition_penalty", "min_tokens")
LEGACY_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
STRUCTURED_OPTIONS = ("disable_any_whitespace",)
MAX_TOP_K = 1_000_000
MAX_REPETITION_PENALTY = 100.0
MAX_CHOICES = 256
MAX_PATTERN_CHARS = 65_536


def _a_schema(value: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(value, str):
        try:
            schema = json.loads(value)
        except ValueError:
            schema = None
        if not isinstance(schema, dict):
            raise BadInput("", "must be a JSON schema: an object, or a string holding one")
    return value


def _compiles(value: str) -> str:
    try:
        re.compile(value)
    except (re.error, RecursionError, OverflowError) as exc:
        raise BadInput("", f"is not a regular expression: {exc}") from None
    return value


_PATTERN = f"must be a non-empty string of at most {MAX_PATTERN_CHARS} characters"
Pattern = Annotated[str, Field(min_length=1, max_length=MAX_PATTERN_CHARS), says(_PATTERN, wrong_type_too=True)]
JsonConstraint = Annotated[
    str | dict[str, Any],
    AfterValidator(_a_schema),
    says("must be a JSON schema: an object, or a string holding one", wrong_type_too=True),
]
RegexConstraint = Annotated[Pattern, AfterValidator(_compiles)]
ChoiceConstraint = Annotated[
    list[Annotated[str, Field(min_length=1)]],
    Field(min_length=1, max_length=MAX_CHOICES),
    says(f"must be an array of 1 to {MAX_CHOICES} non-empty strings", wrong_type_too=True),
]


class StructuredOutputs(Declared):
    """``{"json" | "regex" | "choice" | "grammar" | "json_object": …, "disable_any_whitespace"?: bool}``."""

    model_config = ConfigDict(extra="forbid")
    json_: JsonConstraint | None = Field(None, alias="json")
    regex: RegexConstraint | None = None
    choice: ChoiceConstraint | None = None
    grammar: Pattern | None = None
    json_object: Annotated[Literal[True], says("must be true", wrong_type_too=True)] | None = None
    disable_any_whitespace: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _known(cls, value: Any) -> Any:
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(CONSTRAINTS) - set(STRUCTURED_OPTIONS))
            if unknown:
                raise BadInput(unknown[0], f"is not one of {', '.join(CONSTRAINTS + STRUCTURED_OPTIONS)}")
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [kind for kind in CONSTRAINTS if getattr(self, "json_" if kind == "json" else kind) is not None]
        if len(given) != 1:
            raise BadInput("", f"must give exactly one of {', '.join(CONSTRAINTS)}")
        return self


class SamplingExtras(Declared):
    """vLLM's sampling fields beyond OpenAI's, and its structured outputs by old and new names."""

    top_k: (
        Annotated[
            int,
            Field(ge=-1, le=MAX_TOP_K),
            says(f"must be -1 or 0 (off) or an integer from 1 to {MAX_TOP_K}", wrong_type_too=True),
        ]
        | None
    ) = None
    min_p: Annotated[float, Field(ge=0, le=1), says("must be in [0, 1]")] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=MAX_REPETITION_PENALTY), says("must be in (0, 100]")] | None = (
        None
    )
    min_tokens: (
        Annotated[int, Field(ge=0), says("must be an integer from 0 to max_tokens", wrong_type_too=True)] | None
    ) = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: JsonConstraint | None = None
    guided_regex: RegexConstraint | None = None
    guided_choice: ChoiceConstraint | None = None
    guided_grammar: Pattern | None = None

    def extras(self, max_tokens: int | None) -> dict[str, Any]:
        """The extras given, for the engine: ``min_tokens`` checked against ``max_tokens``."""
        out = {name: getattr(self, name) for name in SAMPLING_EXTRAS if getattr(self, name) is not None}
        ceiling = max_tokens if max_tokens is not None else 1_000_000
        if out.get("min_tokens", 0) > ceiling:
            raise BadInput("min_tokens", f"must be an integer from 0 to max_tokens ({ceiling})")
        if not out.get("min_tokens", 1):
            del out["min_tokens"]  # 0 is the default
        return out

    def constraint(self) -> dict[str, Any] | None:
        """The structured-output constraint asked for, from ``structured_outputs`` or one
        legacy ``guided_*`` field (never both); ``None``: none."""
        legacy = [name for name in LEGACY_GUIDED if getattr(self, name) is not None]
        if self.structured_outputs is not None and legacy:
            raise BadInput(legacy[0], "cannot be combined with structured_outputs")
        if len(legacy) > 1:
            raise BadInput(legacy[1], f"cannot be combined with {legacy[0]}: give one constraint")
        if legacy:
            return {LEGACY_GUIDED[legacy[0]]: getattr(self, legacy[0])}
        if self.structured_outputs is None:
            return None
        return self.structured_outputs.model_dump(by_alias=True, exclude_none=True)


_EXTRAS: TypeAdapter[SamplingExtras] = TypeAdapter(SamplingExtras)
_STRUCTURED: TypeAdapter[StructuredOutputs] = TypeAdapter(StructuredOutputs)


def check_sampling_extras(params: Mapping[str, Any], max_tokens: int | None) -> dict[str, Any]:
    """The extras present in ``params`` (a worker's sampling parameters), checked."""
    return checked(_EXTRAS.validate_python, {name: params.get(name) for name in SAMPLING_EXTRAS}).extras(max_tokens)


def check_structured_outputs(value: Any, param: str = "structured_outputs") -> dict[str, Any]:
    """``{"json" | "regex" | "choice" | "grammar" | "json_object": …, "disable_any_whitespace"?: bool}``."""
    checked(_STRUCTURED.validate_python, value, param)
    return {name: given for name, given in value.items() if given is not None}
