"""Integers a client writes as text (headers, query parameters, paths): one parser, with bounds.

Python's ``int()`` takes what no client means ("²" and "٣" are digits, " 7 " and "+7" and
"7_000" are numbers to it) and refuses outright more than 4,300 digits; a hand-written guard
per route forgot one or the other. :func:`parse_integer` takes ASCII decimal digits only, no
sign, no spaces, no more digits than the bound has (leading zeros aside), and a value within the bounds; anything
else is :class:`IntegerRefused`, whose message says what was expected, for the caller to turn
into its own 400 (the gateway's ``invalid_request_error``, the worker's refusal).
"""

from __future__ import annotations

SHOWN = 40  # characters of a refused value quoted back in the message


class IntegerRefused(ValueError):
    """The text is not an integer within the bounds; ``str()`` says what was expected."""


def parse_integer(text: str, name: str, *, minimum: int = 0, maximum: int) -> int:
    """``text`` as an integer from ``minimum`` to ``maximum`` (0 <= minimum <= maximum)."""
    if text.isascii() and text.isdigit() and len(text.lstrip("0")) <= len(str(maximum)):
        value = int(text)
        if minimum <= value <= maximum:
            return value
    raise IntegerRefused(f"{name} must be an integer from {minimum} to {maximum}, not {quoted(text)}")


def exceeds(text: str, limit: int) -> bool | None:
    """Whether the integer ``text`` is over ``limit`` (True for any number of digits past it);
    None when ``text`` is not a non-negative decimal integer at all."""
    if not (text.isascii() and text.isdigit()):
        return None
    digits = text.lstrip("0") or "0"
    return len(digits) > len(str(limit)) or int(digits) > limit


def quoted(text: str) -> str:
    """``text`` quoted, cut to :data:`SHOWN` characters."""
    return repr(text if len(text) <= SHOWN else text[:SHOWN] + "…")
