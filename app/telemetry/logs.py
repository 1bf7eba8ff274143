"""phasegate's log lines (the gateway's and the worker's): which request, attempt and
instance each is about, as text or JSON.

How this works: the edges bind what a line is about in context variables, so no log call
has to say it. :class:`LogContext`, an ASGI middleware, binds the gateway instance for
every exchange and for the lifespan (whose background tasks, heartbeats and sweeps,
inherit it); the HTTP handler binds the request id with :func:`bind_request` as soon as
it has one, and every task the request spawns inherits it. :class:`ContextFilter` puts
``request_id``, ``attempt`` (bound with the request, as a worker binds the attempt it
serves; else the request's current attempt, asked of the gateway when the line is
written) and ``instance`` on each record, unless the call gave them in ``extra``. Shared
tasks that one request happens to start (a replica's lease renewals) start in
:func:`detached` context, so their lines name no request. A worker binds its own name
as the instance.

Secrets never reach a line: :class:`Redacting` wraps the formatter and replaces every
registered secret (API keys, tokens, DSN passwords) in the finished line, exception
text included.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from datetime import UTC, datetime
from typing import Any

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
REDACTED = "[redacted]"

ASGIApp = Callable[
    [MutableMapping[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]
]

_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("phasegate_request_id", default=None)
_attempt: contextvars.ContextVar[int | None] = contextvars.ContextVar("phasegate_attempt", default=None)
_instance: contextvars.ContextVar[Callable[[], str] | None] = contextvars.ContextVar("phasegate_instance", default=None)
_attempt_of: contextvars.ContextVar[Callable[[str], int | None] | None] = contextvars.ContextVar(
    "phasegate_attempt_of", default=None
)


def bind_request(request_id: str, attempt: int | None = None) -> None:
    """Lines written from here on (in this task and the tasks it starts) are about
    ``request_id``, and about ``attempt`` of it if one is given."""
    _request_id.set(request_id)
    _attempt.set(attempt)


def bind_instance(instance: Callable[[], str]) -> None:
    """Lines written from here on name the gateway instance ``instance()`` returns (its id
    changes when it registers again)."""
    _instance.set(instance)


def detached() -> contextvars.Context:
    """The current context without its request: for a task that serves many requests."""
    context = contextvars.copy_context()
    context.run(_request_id.set, None)
    context.run(_attempt.set, None)
    return context


class LogContext:
    """ASGI middleware: binds the gateway instance (and how to find a request's current
    attempt) for every HTTP exchange and for the lifespan."""

    def __init__(self, app: ASGIApp, instance: Callable[[], str], attempt_of: Callable[[str], int | None]) -> None:
        self.app = app
        self.instance = instance
        self.attempt_of = attempt_of

    async def __call__(
        self,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[Any]],
        send: Callable[[Any], Awaitable[None]],
    ) -> None:
        bind_instance(self.instance)
        _attempt_of.set(self.attempt_of)
        await self.app(scope, receive, send)


class ContextFilter(logging.Filter):
    """Adds ``request_id``, ``attempt`` and ``instance`` to each record (None where unknown)."""

    def filter(self, record: logging.LogRecord) -> bool:
        about = record.__dict__
        if about.get("request_id") is None:
            about["request_id"] = _request_id.get()
        if about.get("attempt") is None:
            about["attempt"] = _attempt.get() if about["request_id"] == _request_id.get() else None
        if about.get("attempt") is None:
            attempt_of, request_id = _attempt_of.get(), about["request_id"]
            about["attempt"] = attempt_of(request_id) if attempt_of is not None and request_id else None
        if about.get("instance") is None:
            instance = _instance.get()
            about["instance"] = instance() if instance is not None else None
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (UTC, ISO 8601), level, logger, message, and what the
    line is about (``request_id``, ``attempt``, ``instance``) where known."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in ("request_id", "attempt", "instance"):
            value = getattr(record, name, None)
            if value is not None:
                line[name] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, ensure_ascii=False, default=str)


class Redacting(logging.Formatter):
    """``inner``'s lines with every registered secret replaced where it stands whole: not
    inside a longer run of letters and digits, so that a short key (``k1``, or a one-letter
    test key) takes itself out of the lines, not every word that contains it."""

    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self.inner = inner
        self.secrets: set[str] = set()
        self._pattern: re.Pattern[str] | None = None

    def add(self, secrets: Iterable[str]) -> None:
        self.secrets.update(secrets)
        longest_first = sorted(self.secrets, key=len, reverse=True)
        whole = "|".join(re.escape(secret) for secret in longest_first)
        self._pattern = re.compile(f"(?<![0-9A-Za-z])(?:{whole})(?![0-9A-Za-z])") if whole else None

    def format(self, record: logging.LogRecord) -> str:
        line = self.inner.format(record)
        return line if self._pattern is None else self._pattern.sub(REDACTED, line)


_redacting: list[Redacting] = []


def configure(level: str = "info", log_format: str = "text") -> None:
    """The process's logging: one stderr handler on the root logger, in ``log_format``."""
    if log_format not in FORMATS:
        raise ValueError(f"log_format must be one of {', '.join(FORMATS)}")
    inner = JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    handler = logging.StreamHandler()
    formatter = Redacting(inner)
    handler.setFormatter(formatter)
    handler.addFilter(ContextFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # alembic's own lines (its plugins, each migration: a dozen a start) only at debug; the
    # upgrade says in one line where the schema went (app/store/migrate.py)
    logging.getLogger("alembic").setLevel(logging.DEBUG if level.lower() == "debug" else logging.WARNING)
    _redacting[:] = [formatter]


def redact(*secrets: str | None) -> None:
    """Never write these strings (empty ones and None are skipped) in a line of this process."""
    for formatter in _redacting:
        formatter.add(secret for secret in secrets if secret)
