"""The worker protocol's shared secret: what a usable one is, and where it is read from.

A worker requires it on every call but the probes (app/worker/auth.py); the gateway sends
it to every worker replica (``worker_token`` in app/config.py). Both read it from the
same environment variable, and hold it to the same rules.
"""

from __future__ import annotations

from pathlib import Path

TOKEN_ENV = "PHASEGATE_WORKER_TOKEN"
MIN_TOKEN_CHARS = 16


class TokenError(ValueError):
    """A token that cannot be used; the message says which and why, never the token."""


def check_token(token: str, source: str) -> str:
    """``token`` if it is usable in an HTTP header and long enough not to guess; else :class:`TokenError`."""
    if len(token) < MIN_TOKEN_CHARS:
        raise TokenError(f"{source}: the worker token must have at least {MIN_TOKEN_CHARS} characters")
    if not all("!" <= c <= "~" for c in token):
        raise TokenError(f"{source}: the worker token must be printable ASCII without spaces")
    return token


def read_token_file(path: Path) -> str:
    """The token in ``path`` (surrounding whitespace, such as a final newline, is dropped)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenError(f"cannot read the worker token file {path}: {exc}") from None
    return check_token(text.strip(), str(path))
