"""Hypothesis strategies for what an untrusted client sends: JSON of any shape, bodies one or
two mutations away from valid ones, bytes that are not JSON at all, header sets, paths,
query strings and ids with the characters that broke the gateway before (NUL, lone
surrogates, superscript digits, 5,000-digit numbers, deep nesting)."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

from hypothesis import strategies as st

# text a parser may choke on: NUL, lone surrogates (high and low), superscript and Arabic-Indic digits,
# a right-to-left mark, the BOM, and plain words
NASTY_TEXT = st.sampled_from(
    ["\x00", "\ud800", "\udc00", "²", "١٢", "\u200f", "\ufeff", "a\x00b", "", " ", "null", "-1"]
)
TEXT = st.one_of(st.text(max_size=40), NASTY_TEXT)
INTEGERS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 1, 2**31, 2**63, -(2**63) - 1, 10**40]),
)
NUMBERS = st.one_of(INTEGERS, st.floats(allow_nan=True, allow_infinity=True))
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)),
    max_leaves=12,
)


def encode(value: Any) -> bytes:
    """``value`` as JSON text, NaN, Infinity and lone surrogates (escaped) included: the gateway must refuse those."""
    return json.dumps(value, allow_nan=True).encode()


NOT_JSON = st.one_of(
    st.binary(max_size=200),
    st.sampled_from(
        [
            b"",
            b"{",
            b'{"model": "sim"',
            b"[" * 100_000,  # 100k deep
            b"[" * 5000 + b"]" * 5000,
            b"1" * 5000,
            b'{"max_tokens": 1' + b"0" * 5000 + b"}",
            b"\xef\xbb\xbf{}",  # a BOM
            b'{"a": NaN}',
            b'{"a": "\\ud800"}',
            b'{"model": "sim", "model": "sim"}',
            b"null",
        ]
    ),
)


def mutated(
    valid: dict[str, Any], fields: list[str], nested: dict[str, st.SearchStrategy[Any]]
) -> st.SearchStrategy[Any]:
    """``valid`` with zero to three changes: a field set to any JSON (one of ``fields``, or an
    unknown name), removed, or set to a shaped value from ``nested``."""

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        body = dict(valid)
        for _ in range(draw(st.integers(0, 3))):
            name = draw(st.one_of(st.sampled_from(fields), TEXT))
            change = draw(st.sampled_from(["any", "remove", "shaped"]))
            if change == "remove":
                body.pop(name, None)
            elif change == "shaped" and name in nested:
                body[name] = draw(nested[name])
            else:
                body[name] = draw(JSON)
        return body

    return build()


def _part() -> st.SearchStrategy[Any]:
    return st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), JSON)


MESSAGE = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "function", ""])},
        optional={
            "content": st.one_of(TEXT, st.lists(_part(), max_size=3), JSON),
            "name": SCALARS,
            "tool_call_id": SCALARS,
            "tool_calls": st.one_of(
                JSON,
                st.lists(
                    st.fixed_dictionaries(
                        {"function": st.fixed_dictionaries({"name": TEXT}, optional={"arguments": JSON})},
                        optional={"id": SCALARS, "type": SCALARS},
                    ),
                    max_size=2,
                ),
            ),
        },
    ),
    JSON,
)
FUNCTION = st.fixed_dictionaries(
    {"name": st.one_of(TEXT, JSON)},
    optional={
        "description": SCALARS,
        "strict": SCALARS,
        "parameters": st.one_of(JSON, st.fixed_dictionaries({"type": TEXT}, optional={"properties": JSON})),
    },
)
TOOLS = st.one_of(
    st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "web"]), "function": FUNCTION}), max_size=3),
    JSON,
)
TOOL_CHOICE = st.one_of(
    st.sampled_from(["none", "auto", "required", "any"]),
    st.fixed_dictionaries({"function": st.one_of(JSON, st.fixed_dictionaries({"name": st.one_of(TEXT, JSON)}))}),
    st.fixed_dictionaries({"type": SCALARS, "function": st.fixed_dictionaries({"name": st.just("f")})}),
)
RESPONSE_FORMAT = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "xml"])}),
    st.fixed_dictionaries(
        {"type": st.just("json_schema"), "json_schema": st.one_of(JSON, st.fixed_dictionaries({"schema": JSON}))}
    ),
    JSON,
)
SHAPED = {
    "messages": st.lists(MESSAGE, max_size=3),
    "tools": TOOLS,
    "tool_choice": TOOL_CHOICE,
    "response_format": RESPONSE_FORMAT,
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=6)),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": SCALARS, "other": SCALARS}),
    "max_tokens": INTEGERS,
    "n": INTEGERS,
    "seed": INTEGERS,
    "temperature": NUMBERS,
    "prompt": st.one_of(TEXT, st.lists(TEXT, max_size=2)),
}

# header values h11 can send (printable latin-1 without CR/LF, up to a few KB), as bytes
HEADER_VALUE = st.one_of(
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=60),
    st.integers(0, 8000).map(lambda n: "v" * n),
).map(lambda text: text.strip(" \t").encode("latin-1"))  # h11 sends no space at either end
HEADER_NAME = st.one_of(
    st.sampled_from(
        [
            "authorization",
            "idempotency-key",
            "last-event-id",
            "x-request-id",
            "accept",
            "accept-encoding",
            "cookie",
            "origin",
            "traceparent",
            "tracestate",
            "x-forwarded-for",
            "content-type",
            "expect",
            "range",
        ]
    ),
    st.from_regex(r"\A[A-Za-z0-9!#$%&'*+.^_`|~-]{1,30}\Z"),
)
HEADERS = st.dictionaries(HEADER_NAME, HEADER_VALUE, max_size=5)

# a path segment or id, percent-encoded as sent: any text, the nasty kind, long digits
_RAW_SEGMENTS = ("%", "%zz")  # malformed percent-encodings, sent as they are (generated text is quoted)
SEGMENT = st.one_of(TEXT, st.sampled_from(["..", ".", *_RAW_SEGMENTS, "1" * 5000, "req_" + "0" * 24])).map(
    lambda text: text if text in _RAW_SEGMENTS else quote(text.encode("utf-8", "surrogatepass"), safe="")
)


def _quoted(value: object) -> str:
    return quote(str(value).encode("utf-8", "surrogatepass"), safe="")


QUERY = st.lists(
    st.tuples(st.one_of(TEXT, st.sampled_from(["after_seq", "limit", "token", "tenant"])), SCALARS), max_size=4
).map(lambda pairs: "&".join(f"{_quoted(k)}={_quoted(v)}" for k, v in pairs))
METHODS = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])
