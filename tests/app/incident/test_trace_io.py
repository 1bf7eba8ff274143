"""``phasegate trace export`` / ``import``: golden traces round-trip byte for byte through
PostgreSQL, and bad traces are refused whole, naming their line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from ops import traces
from statemachine.trace import parse_trace
from tests.app.incident.conftest import Runner
from tests.conftest import run_sync

TRACES = Path(__file__).resolve().parents[2] / "traces"
GOLDEN = sorted(TRACES.glob("*.jsonl"))


def count_events(database_url: str) -> int:
    async def count() -> int:
        engine = create_async_engine(database_url)
        try:
            async with engine.connect() as connection:
                return int((await connection.execute(text("SELECT count(*) FROM request_events"))).scalar_one())
        finally:
            await engine.dispose()

    return int(run_sync(count))


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: p.stem)
def test_export_import_replay_round_trips_a_golden_trace_byte_for_byte(
    phasegate: Runner, path: Path, tmp_path: Path
) -> None:
    golden = path.read_text()
    (request_id,) = json.loads(golden.splitlines()[0])["requests"]
    imported = phasegate("trace", "import", str(path))
    assert imported.status == 0, imported.err
    assert "imported 1 request" in imported.out
    exported = tmp_path / "exported.jsonl"
    ran = phasegate("trace", "export", request_id, "-o", str(exported), "--meta", "source=tests/traces/generate.py")
    assert ran.status == 0, ran.err
    assert exported.read_text() == golden
    divergent = path.stem.startswith("divergent")
    for target in (str(exported), request_id):  # offline from the file, then from the log
        replayed = phasegate("replay", target)
        assert replayed.status == (1 if divergent else 0), replayed.out + replayed.err
        assert ("first divergence at seq 5" if divergent else "no divergence") in replayed.out


def test_export_to_standard_output_without_meta_has_only_the_format_header(phasegate: Runner) -> None:
    assert phasegate("trace", "import", str(TRACES / "clean_completion.jsonl")).status == 0
    ran = phasegate("trace", "export", "req_clean")
    header, *lines = ran.out.splitlines()
    assert json.loads(header) == {"format": "phasegate-trace", "version": 1, "requests": ["req_clean"]}
    assert lines == (TRACES / "clean_completion.jsonl").read_text().splitlines()[1:]
    assert "exported 1 request, 8 events" in ran.err


def test_a_trace_of_many_requests_keeps_their_interleaving(phasegate: Runner, tmp_path: Path) -> None:
    a = traces.retried_before_first_delta("req_a").events
    b = traces.completed("req_b").events
    interleaved = [e for pair in zip(a, b, strict=False) for e in pair] + a[len(b) :]
    from statemachine.trace import dump_trace

    original = "".join(dump_trace(interleaved))
    (tmp_path / "two.jsonl").write_text(original)
    assert phasegate("trace", "import", str(tmp_path / "two.jsonl")).status == 0
    assert phasegate("trace", "export", "req_a", "req_b").out == original


def test_a_trace_of_reasoning_metadata_and_usage_details_round_trips(phasegate: Runner, tmp_path: Path) -> None:
    """Events of schema version 2 (docs/design.md §14): a delta's field, the client's metadata,
    usage details and stop reasons go out and come back as they were, and replay."""
    trace = traces.Trace("req_thought", metadata={"team": "search"}).start("w1").first_token(20).first_delta()
    trace.deliver(" think", key="reasoning").deliver("", key="").deliver("Hi")
    trace.completed(usage_details={"completion_tokens_details": {"reasoning_tokens": 2}}, stop_reasons=("sun",))
    from statemachine.trace import dump_trace

    original = "".join(dump_trace(trace.events))
    assert '"fields": ["reasoning"]' in original and '"metadata": {"team": "search"}' in original
    (tmp_path / "thought.jsonl").write_text(original)
    assert phasegate("trace", "import", str(tmp_path / "thought.jsonl")).status == 0
    assert phasegate("trace", "export", "req_thought").out == original
    assert phasegate("replay", "req_thought").status == 0
    redacted = phasegate("trace", "export", "req_thought", "--redact").out
    assert " think" not in redacted and '"fields": ["reasoning"]' in redacted  # the field is kept, not its text


def test_a_redacted_export_keeps_every_decision_but_no_text(phasegate: Runner, tmp_path: Path) -> None:
    assert phasegate("trace", "import", str(TRACES / "tool_call_replayed.jsonl")).status == 0
    assert phasegate("trace", "import", str(TRACES / "retry_before_first_delta.jsonl")).status == 0
    ran = phasegate("trace", "export", "--since", "2026-11-30T00:00", "--redact", "-o", str(tmp_path / "r.jsonl"))
    assert ran.status == 0, ran.err
    redacted = (tmp_path / "r.jsonl").read_text()
    assert "ok ok" not in redacted and json.loads(redacted.splitlines()[0])["redacted"]
    trace = parse_trace(redacted.splitlines())
    assert set(trace.requests) == {"req_tool", "req_retried"}
    assert phasegate("replay", str(tmp_path / "r.jsonl")).status == 0


def test_export_refuses_unknown_requests_and_empty_selections(phasegate: Runner) -> None:
    ran = phasegate("trace", "export", "req_nobody")
    assert ran.status == 2 and "no such request in the log: req_nobody" in ran.err
    ran = phasegate("trace", "export", "--since", "2030-01-01")
    assert ran.status == 2 and "no request matches" in ran.err
    ran = phasegate("trace", "export")
    assert ran.status == 2 and "needs request ids or a selection" in ran.err
    ran = phasegate("trace", "export", "req_x", "--meta", "version=9")
    assert ran.status == 2 and "--meta takes KEY=VALUE" in ran.err


# --- refusals ----------------------------------------------------------------------------


def golden_lines(name: str = "retry_before_first_delta") -> list[str]:
    return (TRACES / f"{name}.jsonl").read_text().splitlines(keepends=True)


def mixed_request_ids(lines: list[str]) -> list[str]:
    return [*lines[:3], lines[3].replace("req_retried", "req_stranger"), *lines[4:]]


def schema_version(lines: list[str]) -> list[str]:
    return [*lines[:2], lines[2].replace('"v": 1', '"v": 7'), *lines[3:]]


def illegal(lines: list[str]) -> list[str]:
    """The commit point of attempt 2 right after the first decision: well-formed, not legal."""
    commit = json.loads(next(line for line in lines if "FirstDeltaCommitted" in line))
    commit["seq"] = 3
    return [*lines[:3], json.dumps(commit) + "\n"]


BAD = {
    "truncated line": (lambda lines: [*lines[:4], lines[4][:60]], r"line 5: not valid JSON .*truncated"),
    "unknown event type": (
        lambda lines: [*lines[:3], lines[3].replace("AttemptStarted", "AttemptTeleported"), *lines[4:]],
        r"line 4: unknown event type 'AttemptTeleported'",
    ),
    "wrong version order": (
        lambda lines: [lines[0], lines[1], lines[3], lines[2], *lines[4:]],
        r"line 3: seq 3 of request req_retried does not follow seq 1",
    ),
    "mixed request ids": (mixed_request_ids, r"line 4: request req_stranger is not listed in the header"),
    "unsupported event schema version": (schema_version, r"line 3: Decided: unsupported schema version 7"),
    "newer trace format": (
        lambda lines: [lines[0].replace('"version": 1', '"version": 2'), *lines[1:]],
        r"line 1: unsupported trace version 2",
    ),
    "illegal transition": (
        illegal,
        r"line 4: can't handle event FirstDeltaCommitted in phase prefill .*: attempt 2 was never started",
    ),
}


@pytest.mark.parametrize("case", list(BAD), ids=str)
def test_a_bad_trace_is_refused_naming_the_line_and_nothing_is_imported(
    phasegate: Runner, database_url: str, tmp_path: Path, case: str
) -> None:
    mangle, message = BAD[case]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(mangle(golden_lines())))
    ran = phasegate("trace", "import", str(bad))
    assert ran.status == 2
    assert ran.err.startswith(f"phasegate trace: {bad}: ")
    assert re.search(message, ran.err), ran.err
    assert count_events(database_url) == 0
    replayed = phasegate("replay", str(bad))  # replay reads traces the same way
    if case == "illegal transition":  # readable, so replayed up to the event that breaks it
        assert replayed.status == 1 and "the log breaks the state machine at seq 3" in replayed.out
    else:
        assert replayed.status == 2 and re.search(message, replayed.err)


def test_a_duplicate_request_refuses_the_whole_trace(phasegate: Runner, database_url: str, tmp_path: Path) -> None:
    assert phasegate("trace", "import", str(TRACES / "clean_completion.jsonl")).status == 0
    before = count_events(database_url)
    from statemachine.trace import dump_trace

    fresh = traces.completed("req_fresh").events
    clean = parse_trace(golden_lines("clean_completion")).requests["req_clean"]
    both = tmp_path / "both.jsonl"
    both.write_text("".join(dump_trace([*fresh, *clean])))
    ran = phasegate("trace", "import", str(both))
    assert ran.status == 2
    line = len(fresh) + 2  # the header, then req_fresh's events, then req_clean's first
    assert f"{both}: line {line}: request req_clean is already in the database; nothing was imported" in ran.err
    assert count_events(database_url) == before  # req_fresh was not imported either
    again = phasegate("trace", "import", str(TRACES / "clean_completion.jsonl"))
    assert again.status == 2 and "already in the database" in again.err


def test_import_needs_the_schema(phasegate: Runner, empty_database_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATABASE_URL", empty_database_url)
    ran = phasegate("trace", "import", str(TRACES / "clean_completion.jsonl"))
    assert ran.status == 2 and "run 'phasegate db upgrade' first" in ran.err


def test_an_unreadable_file_is_named(phasegate: Runner, tmp_path: Path) -> None:
    ran = phasegate("trace", "import", str(tmp_path / "missing.jsonl"))
    assert ran.status == 2 and "missing.jsonl: cannot read it" in ran.err


def test_the_mangled_traces_are_what_their_names_say() -> None:
    lines = golden_lines()
    assert [json.loads(line)["type"] for line in illegal(lines)[1:]] == [
        "RequestAccepted",
        "Decided",
        "FirstDeltaCommitted",
    ]
    assert json.loads(mixed_request_ids(lines)[3])["request_id"] == "req_stranger"


def test_text_the_log_cannot_hold_is_refused_naming_the_line(
    phasegate: Runner, database_url: str, tmp_path: Path
) -> None:
    lines = golden_lines("clean_completion")
    lines[6] = lines[6].replace('"text": "Hi Hi Hi "', '"text": "Hi \\ud800"')  # a lone surrogate
    bad = tmp_path / "surrogate.jsonl"
    bad.write_text("".join(lines))
    ran = phasegate("trace", "import", str(bad))
    assert ran.status == 2
    assert re.search(r"line 7: a lone UTF-16 surrogate in 'Hi \\ud800'", ran.err), ran.err
    assert count_events(database_url) == 0


def _mangled(lines: list[str], number: int, old: str, new: str) -> list[str]:
    assert old in lines[number - 1], (number, old)
    return [*lines[: number - 1], lines[number - 1].replace(old, new, 1), *lines[number:]]


def _everywhere(lines: list[str], old: str, new: str) -> list[str]:
    return [line.replace(old, new) for line in lines]


# (what, the mangled clean_completion trace, the line named, the message): each was a
# traceback and exit 1, or a silent rewrite of the data, once
UNHOLDABLE = {
    "NUL in the request id": (
        lambda lines: _everywhere(lines, "req_clean", "req\\u0000clean"),
        1,
        r"a NUL character in 'req\\x00clean'",
    ),
    "lone surrogate in the request id": (
        lambda lines: _everywhere(lines, "req_clean", "req\\ud800clean"),
        1,
        r"a lone UTF-16 surrogate in 'req\\ud800clean'",
    ),
    "low surrogate in the request id": (  # once a traceback from the codec
        lambda lines: _everywhere(lines, "req_clean", "req\\udc00clean"),
        1,
        r"a lone UTF-16 surrogate in 'req\\udc00clean'",
    ),
    "5,000-digit integer": (
        lambda lines: _mangled(lines, 4, '"lease_epoch": 1', '"lease_epoch": ' + "9" * 5000),
        4,
        "an integer of thousands of digits",
    ),
    "integer past 64 bits": (
        lambda lines: _mangled(lines, 4, '"lease_epoch": 1', '"lease_epoch": ' + str(2**64)),
        4,
        "an integer outside 64 bits",
    ),
    "100k-deep nesting": (
        lambda lines: _mangled(lines, 4, '"body": {', '"body": {"x": ' + "[" * 100_000 + "]" * 100_000 + ", "),
        4,
        "nested deeper than 64 levels",
    ),
    "NUL in the tenant": (
        lambda lines: _mangled(lines, 2, '"tenant": "default"', '"tenant": "de\\u0000fault"'),
        2,
        "a NUL character in 'de\\\\x00fault'",
    ),
    "NUL in a replica id": (
        lambda lines: _mangled(lines, 4, '"replica_id": "w1"', '"replica_id": "w\\u00001"'),
        4,
        "a NUL character",
    ),
    "NUL in delivered text": (lambda lines: _everywhere(lines, '"Hi Hi Hi "', '"Hi\\u0000"'), 7, "a NUL character"),
    "version true": (
        lambda lines: _mangled(lines, 1, '"version": 1', '"version": true'),
        1,
        "the trace version must be an integer, not true",
    ),
}


@pytest.mark.parametrize("case", list(UNHOLDABLE), ids=str)
def test_what_the_parser_would_crash_on_or_the_log_rewrite_is_refused_naming_the_line(
    phasegate: Runner, database_url: str, tmp_path: Path, case: str
) -> None:
    mangle, line, message = UNHOLDABLE[case]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(mangle(golden_lines("clean_completion"))))
    for command in (("trace", "import"), ("replay",)):
        ran = phasegate(*command, str(bad))
        assert ran.status == 2, ran.err
        assert ran.err.startswith(f"phasegate {command[0]}: {bad}: line {line}: "), ran.err
        assert re.search(message, ran.err), ran.err
    assert count_events(database_url) == 0


def test_a_listed_request_without_events_names_the_header_line(phasegate: Runner, tmp_path: Path) -> None:
    lines = golden_lines("clean_completion")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n" + lines[0].replace('["req_clean"]', '["req_clean", "req_ghost"]') + "".join(lines[1:]))
    ran = phasegate("trace", "import", str(bad))
    assert ran.status == 2 and f"{bad}: line 2: no events for listed request(s) req_ghost" in ran.err, ran.err


# (the mangled retry_before_first_delta trace, the line named, the message): well-formed
# events that the state machine refuses, so import refuses them too
REFUSED_BY_THE_FOLD = {
    "tokens that disagree with the indexes": (
        lambda lines: _mangled(lines, 11, '"tokens": 4', '"tokens": 9'),
        11,
        "the deltas' shapes disagree with the indexes, the tokens or the text",
    ),
    "an unknown finish reason": (
        lambda lines: _mangled(lines, 12, '"finish_reason": "stop"', '"finish_reason": "finished"'),
        12,
        "unknown finish reason 'finished'",
    ),
    "a negative lease epoch": (
        lambda lines: _mangled(lines, 4, '"lease_epoch": 1', '"lease_epoch": -1'),
        4,
        "negative lease epoch -1",
    ),
    "time going backwards": (
        lambda lines: _mangled(lines, 6, "2026-11-30T12:00:00.005000+00:00", "2026-11-30T11:59:59+00:00"),
        6,
        r"time goes back: 2026-11-30T11:59:59\+00:00 is before 2026-11-30T12:00:00.004000\+00:00",
    ),
    "a negative usage count": (
        lambda lines: _mangled(lines, 12, '"completion_tokens": 4', '"completion_tokens": -4'),
        12,
        "negative usage count",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED_BY_THE_FOLD), ids=str)
def test_what_the_state_machine_refuses_import_refuses_naming_the_line(
    phasegate: Runner, database_url: str, tmp_path: Path, case: str
) -> None:
    mangle, line, message = REFUSED_BY_THE_FOLD[case]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(mangle(golden_lines())))
    ran = phasegate("trace", "import", str(bad))
    assert ran.status == 2, ran.err
    assert ran.err.startswith(f"phasegate trace: {bad}: line {line}: "), ran.err
    assert re.search(message, ran.err), ran.err
    assert "Traceback" not in ran.err and count_events(database_url) == 0
    replayed = phasegate("replay", str(bad))  # readable, so replayed up to the event that breaks it
    seq = json.loads(mangle(golden_lines())[line - 1])["seq"]
    assert replayed.status == 1 and f"the log breaks the state machine at seq {seq}" in replayed.out
