"""The parser of each event field's type, as :mod:`statemachine.jsonform` reads an event's
body: a JSON value checked against the field's annotation and turned into its value (a
datetime, an enum member, a tuple, log probabilities), or a ``TypeError``/``ValueError``
that says why not. Built once per field at import (:func:`parser_for`)."""

from __future__ import annotations

import enum
import types
import typing
from datetime import datetime
from typing import Any

from statemachine.deltas import (
    ChoicePromptLogprobs,
    ChoicePrompts,
    ChoicePromptTokens,
    DeltaLogprobs,
    DeltaTokenIds,
    PromptLogprobs,
    PromptTokenLogprob,
    TokenLogprob,
)


def _exact(expected: type) -> typing.Callable[[Any], Any]:
    """A plain field's parser. ``from_json`` takes a value of exactly the field's type as
    it is, so this sees only the others and refuses them (bool is an int in Python, but a
    JSON true is never a valid count or index)."""

    def parse(value: Any) -> Any:
        raise TypeError(f"expected {expected.__name__}, got {type(value).__name__}")

    return parse


def _parse_seconds(value: Any) -> float:
    """A duration in seconds: a JSON number, whole or not (never a bool)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"expected a number, got {type(value).__name__}")
    return float(value)


def _parse_datetime(value: Any) -> datetime:
    if not isinstance(value, str):
        raise TypeError(f"expected an ISO 8601 string, got {type(value).__name__}")
    parsed = datetime.fromisoformat(value)
    if parsed.tzinfo is None:
        raise ValueError("timestamp has no UTC offset")
    return parsed


def _parse_enum(enum_cls: type[enum.StrEnum]) -> typing.Callable[[Any], Any]:
    members = {member.value: member for member in enum_cls}

    def parse(value: Any) -> Any:
        member = members.get(value) if isinstance(value, str) else None
        if member is None:
            if not isinstance(value, str):
                raise TypeError(f"expected a string, got {type(value).__name__}")
            raise ValueError(f"{value!r} is not one of {', '.join(members)}")
        return member

    return parse


def _parse_str_tuple(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise TypeError("expected a list of strings")
    return tuple(value)


def _parse_stop_reasons(value: Any) -> tuple[str | int | None, ...]:
    if not isinstance(value, list) or not all(item is None or type(item) in (str, int) for item in value):
        raise TypeError("expected a list of stop strings, token ids or nulls")
    return tuple(value)


def _parse_int_triples(value: Any) -> tuple[tuple[int, int, int], ...]:
    if not isinstance(value, list) or not all(
        isinstance(item, list) and len(item) == 3 and all(type(n) is int and n >= 0 for n in item) for item in value
    ):
        raise TypeError("expected a list of [choice, characters, tokens]")
    return tuple((item[0], item[1], item[2]) for item in value)


def _parse_int_pairs(value: Any) -> tuple[tuple[int, int], ...]:
    if not isinstance(value, list) or not all(
        isinstance(item, list) and len(item) == 2 and all(type(n) is int and n >= 0 for n in item) for item in value
    ):
        raise TypeError("expected a list of [choice, prompt tokens]")
    return tuple((item[0], item[1]) for item in value)


def _token_ids(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(n) is int and n >= 0 for n in value):
        raise TypeError(f"expected a list of token ids, got {value!r:.80}")
    return tuple(value)


def _parse_delta_token_ids(value: Any) -> DeltaTokenIds:
    if not isinstance(value, list):
        raise TypeError("expected per delta a list of token ids")
    return tuple(_token_ids(delta) for delta in value)


def _parse_choice_prompts(value: Any) -> ChoicePrompts:
    if not isinstance(value, list) or not all(
        isinstance(item, list)
        and len(item) == 3
        and type(item[0]) is int
        and item[0] >= 0
        and (item[2] is None or isinstance(item[2], str))
        for item in value
    ):
        raise TypeError("expected a list of [choice, token ids or null, prompt text or null]")
    return tuple((item[0], None if item[1] is None else _token_ids(item[1]), item[2]) for item in value)


def _parse_choice_prompt_logprobs(value: Any) -> ChoicePromptLogprobs:
    if not isinstance(value, list) or not all(
        isinstance(item, list) and len(item) == 2 and type(item[0]) is int and item[0] >= 0 for item in value
    ):
        raise TypeError("expected a list of [choice, the prompt's log probabilities]")
    return tuple((item[0], prompt_logprobs(item[1])) for item in value)


def prompt_logprobs(value: Any) -> PromptLogprobs:
    """A prompt's log probabilities (:data:`PromptLogprobs`) from their JSON form: per prompt
    token null, or a list of [token id, logprob, rank or null, decoded text or null]."""
    if not isinstance(value, list):
        raise TypeError(f"expected per prompt token null or a list of log probabilities, got {value!r:.80}")
    return tuple(None if place is None else _prompt_place(place) for place in value)


def _prompt_place(place: Any) -> tuple[PromptTokenLogprob, ...]:
    if not isinstance(place, list):
        raise TypeError(f"expected a prompt token's log probabilities, got {place!r:.80}")
    return tuple(_prompt_token_logprob(entry) for entry in place)


def _prompt_token_logprob(entry: Any) -> PromptTokenLogprob:
    if (
        not isinstance(entry, list)
        or len(entry) != 4
        or type(entry[0]) is not int
        or entry[0] < 0
        or (entry[2] is not None and type(entry[2]) is not int)
        or (entry[3] is not None and not isinstance(entry[3], str))
    ):
        raise TypeError(f"expected [token id, logprob, rank or null, text or null], got {entry!r:.80}")
    return (entry[0], _logprob(entry[1]), entry[2], entry[3])


def _parse_delta_logprobs(value: Any) -> DeltaLogprobs:
    if not isinstance(value, list) or not all(isinstance(delta, list) for delta in value):
        raise TypeError("expected per delta a list of [token, logprob, [[alternative, logprob], …]]")
    return tuple(tuple(_token_logprob(entry) for entry in delta) for delta in value)


def _token_logprob(entry: Any) -> TokenLogprob:
    if not isinstance(entry, list) or not 3 <= len(entry) <= 4 or not isinstance(entry[2], list):
        raise TypeError(f"expected [token, logprob, [[alternative, logprob], …](, text)], got {entry!r}")
    token, logprob, top = entry[:3]
    if logprob is None and not top:  # an echoed prompt's first token: none, as vLLM gives it
        said: TokenLogprob = (_token(token), None, ())
    else:
        said = (_token(token), _logprob(logprob), tuple(_alternative(item) for item in top))
    return said if len(entry) == 3 else (*said, _token(entry[3]))


def _alternative(item: Any) -> tuple[str, float]:
    if not isinstance(item, list) or len(item) != 2:
        raise TypeError(f"expected [alternative, logprob], got {item!r}")
    return (_token(item[0]), _logprob(item[1]))


def _token(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a token string, got {type(value).__name__}")
    return value


def _logprob(value: Any) -> float:
    if type(value) not in (int, float) or not value <= 0:  # NaN is not <= 0 either
        raise ValueError(f"expected a log probability (a number at most 0), got {value!r}")
    return float(value)


def _parse_int_map(value: Any) -> dict[str, int]:
    if not isinstance(value, dict) or not all(type(item) is int for item in value.values()):
        raise TypeError("expected an object of integers")
    return dict(value)


def _parse_object(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"expected an object, got {type(value).__name__}")
    return dict(value)


def _optional(parser: typing.Callable[[Any], Any]) -> typing.Callable[[Any], Any]:
    def parse(value: Any) -> Any:
        return None if value is None else parser(value)

    return parse


def parser_for(annotation: Any) -> typing.Callable[[Any], Any]:
    args = typing.get_args(annotation)
    if type(None) in args:
        (inner,) = (arg for arg in args if arg is not type(None))
        return _optional(parser_for(inner))
    if annotation is datetime:
        return _parse_datetime
    if isinstance(annotation, type) and issubclass(annotation, enum.StrEnum):
        return _parse_enum(annotation)
    if annotation in (str, int, bool):
        return _exact(annotation)
    if annotation is float:
        return _parse_seconds
    if annotation == tuple[str, ...]:
        return _parse_str_tuple
    if annotation == tuple[str | int | None, ...]:
        return _parse_stop_reasons
    if annotation == dict[str, int]:
        return _parse_int_map
    if annotation == tuple[tuple[int, int, int], ...]:
        return _parse_int_triples
    if annotation == ChoicePromptTokens:
        return _parse_int_pairs
    if annotation == DeltaLogprobs:
        return _parse_delta_logprobs
    if annotation == DeltaTokenIds:
        return _parse_delta_token_ids
    if annotation == ChoicePrompts:
        return _parse_choice_prompts
    if annotation == ChoicePromptLogprobs:
        return _parse_choice_prompt_logprobs
    if annotation == dict[str, Any]:
        return _parse_object
    raise TypeError(f"no JSON parser for {annotation!r}")  # pragma: no cover - import-time guard


def plain_types(annotation: Any) -> frozenset[type]:
    """The JSON value types a field takes as they are (for ``from_json``'s fast path)."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    args = typing.get_args(annotation) if union else (annotation,)
    return frozenset(arg for arg in args if arg in (str, int, bool, type(None)))
