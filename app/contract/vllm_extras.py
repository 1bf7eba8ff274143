"""vLLM's extra sampling parameters, as ``vllm serve`` takes them: one rule for both sides.

The gateway (app/api/schemas.py) and the worker (app/worker/protocol.py) both call these
checks, and both pass the values on under the names the installed vLLM reads (0.32:
``structured_outputs`` on its OpenAI server, ``SamplingParams`` in process):

- ``top_k`` (-1 or 0: off, else at least 1), ``min_p`` ([0, 1]), ``repetition_penalty``
  (greater than 0), ``min_tokens`` (0 up to ``max_tokens``);
- structured outputs: ``structured_outputs`` with exactly one of ``json`` (a schema: an
  object, or a string holding one), ``regex``, ``choice`` (strings), ``grammar`` or
  ``json_object: true``. The older guided-decoding fields (``guided_json``,
  ``guided_regex``, ``guided_choice``, ``guided_grammar``), which vLLM 0.32 ignores without
  a word, are taken as the same constraint, so a client written for them still gets
  constrained output rather than free text.

A failed check raises :class:`~app.contract.engine_inputs.BadInput` naming the parameter.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from app.contract.engine_inputs import BadInput

SAMPLING_EXTRAS = ("top_k", "min_p", "repetition_penalty", "min_tokens")
LEGACY_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
STRUCTURED_OPTIONS = ("disable_any_whitespace",)
MAX_TOP_K = 1_000_000
MAX_REPETITION_PENALTY = 100.0
MAX_CHOICES = 256
MAX_PATTERN_CHARS = 65_536


def check_sampling_extras(params: Mapping[str, Any], max_tokens: int | None, prefix: str = "") -> dict[str, Any]:
    """The extras present in ``params``, checked; ``prefix`` is the path to ``params`` in the request."""
    out: dict[str, Any] = {}
    if params.get("top_k") is not None:
        top_k = params["top_k"]
        if not _is_int(top_k) or not -1 <= top_k <= MAX_TOP_K:
            raise BadInput(prefix + "top_k", f"must be -1 or 0 (off) or an integer from 1 to {MAX_TOP_K}")
        out["top_k"] = top_k
    if params.get("min_p") is not None:
        out["min_p"] = _number(params["min_p"], prefix + "min_p", 0.0, 1.0, "in [0, 1]")
    if params.get("repetition_penalty") is not None:
        penalty = _number(
            params["repetition_penalty"], prefix + "repetition_penalty", 0.0, MAX_REPETITION_PENALTY, "in (0, 100]"
        )
        if penalty == 0.0:
            raise BadInput(prefix + "repetition_penalty", "must be in (0, 100]")
        out["repetition_penalty"] = penalty
    if params.get("min_tokens") is not None:
        min_tokens = params["min_tokens"]
        ceiling = max_tokens if max_tokens is not None else 1_000_000
        if not _is_int(min_tokens) or not 0 <= min_tokens <= ceiling:
            raise BadInput(prefix + "min_tokens", f"must be an integer from 0 to max_tokens ({ceiling})")
        if min_tokens:
            out["min_tokens"] = min_tokens
    return out


def structured_outputs_of(body: Mapping[str, Any], prefix: str = "") -> dict[str, Any] | None:
    """The request's structured-output constraint, from ``structured_outputs`` or one legacy
    ``guided_*`` field (never both), checked; ``None`` when it asks for none."""
    legacy = [name for name in LEGACY_GUIDED if body.get(name) is not None]
    given = body.get("structured_outputs")
    if given is not None and legacy:
        raise BadInput(prefix + legacy[0], "cannot be combined with structured_outputs")
    if len(legacy) > 1:
        raise BadInput(prefix + legacy[1], f"cannot be combined with {legacy[0]}: give one constraint")
    if legacy:
        name = legacy[0]
        return {LEGACY_GUIDED[name]: _constraint(LEGACY_GUIDED[name], body[name], prefix + name)}
    if given is None:
        return None
    return check_structured_outputs(given, prefix + "structured_outputs")


def check_structured_outputs(value: Any, param: str = "structured_outputs") -> dict[str, Any]:
    """``{"json" | "regex" | "choice" | "grammar" | "json_object": …, "disable_any_whitespace"?: bool}``."""
    if not isinstance(value, dict):
        raise BadInput(param, "must be an object")
    unknown = sorted(set(value) - set(CONSTRAINTS) - set(STRUCTURED_OPTIONS))
    if unknown:
        raise BadInput(f"{param}.{unknown[0]}", f"is not one of {', '.join(CONSTRAINTS + STRUCTURED_OPTIONS)}")
    kinds = [kind for kind in CONSTRAINTS if value.get(kind) is not None]
    if len(kinds) != 1:
        raise BadInput(param, f"must give exactly one of {', '.join(CONSTRAINTS)}")
    (kind,) = kinds
    out = {kind: _constraint(kind, value[kind], f"{param}.{kind}")}
    option = value.get("disable_any_whitespace")
    if option is not None:
        if not isinstance(option, bool):
            raise BadInput(f"{param}.disable_any_whitespace", "must be a boolean")
        out["disable_any_whitespace"] = option
    return out


def _constraint(kind: str, value: Any, param: str) -> Any:
    if kind == "json":
        schema = value
        if isinstance(value, str):
            try:
                schema = json.loads(value)
            except ValueError:
                raise BadInput(param, "must be a JSON schema: an object, or a string holding one") from None
        if not isinstance(schema, dict):
            raise BadInput(param, "must be a JSON schema: an object, or a string holding one")
        return value
    if kind == "json_object":
        if value is not True:
            raise BadInput(param, "must be true")
        return True
    if kind == "choice":
        if (
            not isinstance(value, list)
            or not 1 <= len(value) <= MAX_CHOICES
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise BadInput(param, f"must be an array of 1 to {MAX_CHOICES} non-empty strings")
        return value
    if not isinstance(value, str) or not value or len(value) > MAX_PATTERN_CHARS:
        raise BadInput(param, f"must be a non-empty string of at most {MAX_PATTERN_CHARS} characters")
    if kind == "regex":
        try:
            re.compile(value)
        except (re.error, RecursionError, OverflowError) as exc:
            raise BadInput(param, f"is not a regular expression: {exc}") from None
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any, param: str, low: float, high: float, interval: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise BadInput(param, "must be a number")
    if not low <= value <= high:
        raise BadInput(param, f"must be {interval}")
    return float(value)
