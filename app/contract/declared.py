"""How a request is declared: pydantic models, read as JSON reads, and one error a refusal.

The request models (app/contract/requests.py, and the parts the engines read:
app/contract/engine_inputs.py, app/contract/vllm_extras.py) are pydantic v2 models on
:class:`Declared`: strict (JSON's ``true`` is not an integer, ``"1"`` not a number), no
NaN or infinity, and any field they do not declare allowed, as vLLM's own request models
allow it. From them come both the checks and ``/openapi.json``.

A failed check is one :class:`BadInput`, the first problem pydantic found, named by its
path in the request (``tools[0].function.name``) and said in words (``must be a
string``); each side (the gateway's 400, the worker's refusal) wraps it in its own shape.
A rule that no type says (two fields that exclude each other) raises :class:`BadInput`
from a validator, with its path relative to where it is declared. :func:`says` gives a
value's constraint its own words.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Discriminator, ValidationError, ValidatorFunctionWrapHandler, WrapValidator
from pydantic_core import PydanticCustomError

# a tag of one branch of a union (pydantic puts it in an error's path): left out of the path
TAG = "~"
T = TypeVar("T")
SAID = "phasegate"  # the error type of a constraint said in its own words
NOT_SERVED = "phasegate_not_served"  # … of a value phasegate does not serve (NotServed)

# pydantic's error types that say only that a value is of the wrong JSON type
_WRONG_TYPE = {
    "bool_type": "must be a boolean",
    "int_type": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "finite_number": "must be a number",
    "string_type": "must be a string",
    "list_type": "must be an array",
    "dict_type": "must be an object",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
}


class BadInput(ValueError):
    """``param`` (a path such as ``messages[2].content``) ``why`` (``must be a string``)."""

    def __init__(self, param: str, why: str) -> None:
        super().__init__(f"'{param}' {why}")
        self.param = param
        self.why = why


class NotServed(BadInput):
    """A value phasegate understands and does not serve (a client's 400 ``unsupported_parameter``)."""


class Declared(BaseModel):
    """A request, or a part of one, as JSON gives it."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow", frozen=True)


def says(why: str, *, wrong_type_too: bool = False, not_served: bool = False) -> WrapValidator:
    """A constraint's refusal in words (``must be in [0, 1]``); a value of the wrong JSON
    type keeps the plain ``must be a number`` unless ``wrong_type_too`` (a union, whose
    branches' problems would not say what it takes). ``not_served``: what the constraint
    leaves out is understood and not served (:class:`NotServed`)."""

    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError as error:
            if not wrong_type_too and all(problem["type"] in _WRONG_TYPE for problem in error.errors()):
                raise
            raise PydanticCustomError(NOT_SERVED if not_served else SAID, why) from None

    return WrapValidator(check)


def tagged(kind: Callable[[Any], str | None], refusal: str) -> Discriminator:
    """A union whose branch ``kind`` picks by the value's tag (:data:`TAG` first); a value it
    tags ``None`` is refused in words (``must be an object``)."""
    return Discriminator(kind, custom_error_type=SAID, custom_error_message=refusal)


def by_json_type(*types: type) -> Callable[[Any], str | None]:
    """Tags a value by its JSON type among ``types`` (``~str``, ``~list``, ``~dict``); ``None`` otherwise."""

    def kind(value: Any) -> str | None:
        return TAG + type(value).__name__ if isinstance(value, types) else None

    return kind


def by_type(kinds: dict[str, str], default: str | None = None, other: str = "other") -> Callable[[Any], str | None]:
    """Tags an object by its ``type`` field (``default`` when it has none; a type not in
    ``kinds``: ``other``); ``None`` for a value that is not an object."""

    def kind(value: Any) -> str | None:
        if not isinstance(value, dict):
            return None
        return TAG + kinds.get(str(value.get("type", default)), other)

    return kind


def checked(validate: Callable[[Any], T], value: Any, param: str = "") -> T:
    """``validate(value)`` (a model's or an adapter's), its first problem raised as a
    :class:`BadInput` named by its path under ``param``."""
    try:
        return validate(value)
    except ValidationError as error:
        raise problem(error, param) from None


def problem(error: ValidationError, prefix: str = "") -> BadInput:
    """The first problem of ``error``, named by its path in the request (``prefix``: the path
    of what was validated, as ``messages[0]``)."""
    first = error.errors(include_url=False)[0]
    path = prefix
    for part in first["loc"]:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not part.startswith(TAG) and "[" not in part:  # pydantic's label of a union's member
            path = f"{path}.{part}" if path else part
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, BadInput):
        return type(cause)(joined(path, cause.param), cause.why)
    if first["type"] == NOT_SERVED:
        return NotServed(path, str(first["msg"]))
    return BadInput(path, _why(first))


def joined(path: str, param: str) -> str:
    """``param``, a path relative to ``path`` (``[1].name``, ``name``, or ``""``: itself)."""
    if not path or not param:
        return path or param
    return path + param if param.startswith("[") else f"{path}.{param}"


def _why(first: Any) -> str:
    kind, ctx = first["type"], first.get("ctx") or {}
    if kind in _WRONG_TYPE:
        return _WRONG_TYPE[kind]
    if kind == "missing":
        return "is required"
    if kind == "literal_error":
        return f"must be one of {ctx['expected'].replace(' or ', ', ')}".replace("'", "")
    if kind in {"too_short", "string_too_short"} and ctx.get("min_length") == 1:
        return "must not be empty"
    if kind == "extra_forbidden":
        return "is not allowed"
    if kind == "none_required":
        return "must be null"
    message = str(first["msg"])  # said in words (SAID, NOT_SERVED), or pydantic's own
    return "must " + message.removeprefix("Input should ") if message.startswith("Input should ") else message
