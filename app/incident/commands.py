"""``phasegate replay`` and ``phasegate trace``: the incident responder's command line.

    phasegate replay REQUEST_ID…            from the log (DATABASE_URL, or the embedded server)
    phasegate replay trace.jsonl            offline: no database at all
    phasegate replay --since 2026-11-30T00:00 [--until …] [--model M] [--outcome failed]
    phasegate trace export REQUEST_ID… | --since … [--redact] [-o FILE]
    phasegate trace import FILE

Exit status: 0 when every request replays with the recorded decisions, 1 when one
diverges (or its log breaks the state machine), 2 when nothing could be replayed
(bad arguments, an unreadable or refused trace, an unknown request, no database).
Times without an offset are UTC. See docs/incidents.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tomllib
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from app.incident.describe import plural
from app.store.queries import OUTCOMES, Selection
from statemachine.events import Event
from statemachine.policy_config import PolicyConfig

OK, DIVERGED, UNUSABLE = 0, 1, 2

T = TypeVar("T")


class CommandError(Exception):
    """Nothing could be done; the message says why (exit status 2)."""


def add_incident_parsers(subparsers: Any) -> None:
    """Register ``replay`` and ``trace`` on the CLI's subparsers."""
    replay = subparsers.add_parser(
        "replay",
        help="re-run the recorded decisions of requests (from the log or a trace file) and name any divergence",
    )
    replay.add_argument(
        "targets", nargs="*", metavar="REQUEST_ID|TRACE", help="request ids, or trace files (- for stdin)"
    )
    _add_selection(replay)
    replay.add_argument("--policy", type=Path, metavar="FILE", help="replay with this policy (TOML or JSON)")
    replay.add_argument("-q", "--quiet", action="store_true", help="no timeline tables, only the verdicts")
    replay.set_defaults(run=_run_replay)

    trace = subparsers.add_parser("trace", help="export requests as a trace file, or import one")
    commands = trace.add_subparsers(dest="trace_command", required=True)
    export = commands.add_parser("export", help="write requests' events as a JSONL trace")
    export.add_argument("request_ids", nargs="*", metavar="REQUEST_ID")
    _add_selection(export)
    export.add_argument("--redact", action="store_true", help="drop delivered text and tool call arguments")
    export.add_argument("-o", "--output", type=Path, help="write here instead of standard output")
    export.add_argument("--meta", action="append", default=[], metavar="KEY=VALUE", help="a header field (repeatable)")
    load = commands.add_parser("import", help="load a trace into the database: all of it, or nothing")
    load.add_argument("file", help="the trace (- for stdin)")
    trace.set_defaults(run=_run_trace)


def _add_selection(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--since", type=_timestamp, metavar="TIME", help="requests accepted at or after TIME")
    parser.add_argument("--until", type=_timestamp, metavar="TIME", help="… and before TIME")
    parser.add_argument("--model", help="only requests for this model")
    parser.add_argument("--outcome", choices=OUTCOMES, help="only requests that ended so")
    parser.add_argument("--limit", type=int, help="at most this many requests (the oldest)")


def _timestamp(text: str) -> datetime:
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 time: {text!r} (e.g. 2026-11-30T00:00)") from None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


def _selection(args: argparse.Namespace) -> Selection | None:
    if args.since is None and args.until is None and args.model is None and args.outcome is None:
        return None
    return Selection(since=args.since, until=args.until, model=args.model, outcome=args.outcome, limit=args.limit)


def _guarded(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def guarded(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except CommandError as exc:
            print(f"phasegate {args.command}: {exc}", file=sys.stderr)
            return UNUSABLE

    return guarded


# --- replay ---------------------------------------------------------------------------------


@_guarded
def _run_replay(args: argparse.Namespace) -> int:
    from app.incident.single import replay_report

    config = load_policy(args.policy) if args.policy else None  # None: each request's recorded budget
    selection = _selection(args)
    if selection is not None and args.targets:
        raise CommandError("give request ids or trace files, or a selection (--since …), not both")
    if selection is None and not args.targets:
        raise CommandError("what to replay? give a request id, a trace file, or --since TIME")
    if selection is not None:
        return _with_database(lambda url: _replay_selection(url, selection, config))
    files = [target for target in args.targets if _is_trace_file(target)]
    request_ids = [target for target in args.targets if not _is_trace_file(target)]
    streams: list[list[Event]] = []
    for path in files:
        streams.extend(_read_trace(path).requests.values())
    if request_ids:
        streams.extend(_with_database(lambda url: _read_from_log(url, request_ids)))
    return replay_report(streams, config, sys.stdout, timelines=not args.quiet)


def _is_trace_file(target: str) -> bool:
    return target == "-" or target.endswith((".jsonl", ".json")) or Path(target).is_file()


def load_policy(path: Path) -> PolicyConfig:
    """A policy from a TOML or JSON file: a flat mapping, or a gateway config's ``[policy]`` table."""
    try:
        text = path.read_text(encoding="utf-8")
        values = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (OSError, ValueError) as exc:  # JSONDecodeError and TOMLDecodeError are ValueErrors
        raise CommandError(f"cannot read the policy {path}: {exc}") from None
    if isinstance(values, dict) and isinstance(values.get("policy"), dict):
        values = values["policy"]
    if not isinstance(values, dict):
        raise CommandError(f"the policy {path} must be a mapping of settings")
    try:
        return PolicyConfig.from_mapping(values)
    except (TypeError, ValueError) as exc:
        raise CommandError(f"the policy {path}: {exc}") from None


def _read_trace(path: str) -> Any:
    from app.incident.trace_io import TraceRefused, read_trace

    try:
        return read_trace(path)
    except TraceRefused as exc:
        raise CommandError(str(exc)) from None


async def _read_from_log(url: str, request_ids: Sequence[str]) -> list[list[Event]]:
    from app.store.queries import read_requests

    async with _connected(url) as connection:
        streams = [events async for events in read_requests(connection, request_ids)]
    missing = sorted(set(request_ids) - {events[0].request_id for events in streams})
    if missing:
        raise CommandError(f"no such request in the log: {', '.join(missing)}")
    order = {request_id: index for index, request_id in enumerate(request_ids)}
    return sorted(streams, key=lambda events: order[events[0].request_id])


async def _replay_selection(url: str, selection: Selection, config: PolicyConfig | None) -> int:
    from app.incident.bulk import Progress, replay_many
    from app.incident.timeline import describe_config
    from app.store.queries import read_requests, select_requests

    async with _connected(url) as connection:
        request_ids = await select_requests(connection, selection)
        policy = describe_config(config) if config else "the defaults and each request's recorded max_attempts"
        print(f"replaying {plural(len(request_ids), 'request')} with {policy}", file=sys.stderr)
        progress = Progress(len(request_ids), sys.stderr)
        summary = await replay_many(read_requests(connection, request_ids), len(request_ids), config, progress)
    print(summary.render())
    return OK if summary.ok else DIVERGED


# --- trace ----------------------------------------------------------------------------------


@_guarded
def _run_trace(args: argparse.Namespace) -> int:
    if args.trace_command == "import":
        return _import(args.file)
    return _export(args)


def _export(args: argparse.Namespace) -> int:
    selection = _selection(args)
    if (selection is None) == (not args.request_ids):
        raise CommandError("export needs request ids or a selection (--since …), one of the two")
    meta: dict[str, Any] = {}
    for item in args.meta:
        key, sep, value = item.partition("=")
        if not sep or not key or key in ("format", "version", "requests", "redacted"):
            raise CommandError(f"--meta takes KEY=VALUE with a key of your own, not {item!r}")
        meta[key] = value

    async def export(url: str) -> int:
        from app.incident.trace_io import export_trace
        from app.store.queries import known_requests, select_requests

        async with _connected(url) as connection:
            if selection is not None:
                request_ids = await select_requests(connection, selection)
            else:
                request_ids = list(dict.fromkeys(args.request_ids))
                missing = sorted(set(request_ids) - await known_requests(connection, request_ids))
                if missing:
                    raise CommandError(f"no such request in the log: {', '.join(missing)}")
            if not request_ids:
                raise CommandError("no request matches the selection; nothing was written")
            with _output(args.output) as out:
                events = await export_trace(connection, request_ids, out, redact=args.redact, meta=meta)
        where = args.output or "standard output"
        counts = f"{plural(len(request_ids), 'request')}, {plural(events, 'event')}"
        print(f"exported {counts} to {where}", file=sys.stderr)
        return OK

    return _with_database(export)


def _import(path: str) -> int:
    from app.incident.trace_io import TraceRefused, import_trace

    trace = _read_trace(path)
    name = "<stdin>" if path == "-" else path

    async def load(url: str) -> int:
        try:
            imported = await import_trace(url, trace, name=name)
        except TraceRefused as exc:
            raise CommandError(str(exc)) from None
        print(f"imported {plural(imported.requests, 'request')}, {plural(imported.events, 'event')} from {name}")
        return OK

    return _with_database(load)


@contextmanager
def _output(path: Path | None) -> Iterator[Any]:
    if path is None:
        yield sys.stdout
        return
    try:
        with path.open("w", encoding="utf-8") as out:
            yield out
    except OSError as exc:
        raise CommandError(f"cannot write {path}: {exc}") from None


# --- the database ---------------------------------------------------------------------------


def _with_database(work: Callable[[str], Coroutine[Any, Any, T]]) -> T:
    """Run ``work(url)`` on the log's database (``DATABASE_URL``, or the embedded server)."""
    from app.store.database import database_from_env
    from app.store.errors import is_unavailable

    try:
        url, server = database_from_env()
    except Exception as exc:
        raise CommandError(f"cannot start or reach the database: {exc}") from None
    if server is not None:
        server.stop_on_signals()
    try:
        return asyncio.run(work(url))
    except Exception as exc:
        if is_unavailable(exc):
            raise CommandError(f"cannot reach the database: {str(exc).strip().splitlines()[0]}") from None
        raise
    finally:
        if server is not None:
            server.stop()


@asynccontextmanager
async def _connected(url: str) -> AsyncIterator[Any]:
    """An SQLAlchemy connection to ``url`` for the length of a command."""
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(url)
    try:
        async with engine.connect() as connection:
            yield connection
    finally:
        await engine.dispose()
