"""docs/runbook.md works at 3 a.m.: for each incident kind, its alert exists, its SQL runs and
finds the incident, and its commands run and explain it.

The log is recorded first (tests/ops/incident_log.py): each incident is driven through
real gateways, real sim workers and the real PostgreSQL by its fault. Then, section by
section of the runbook: every alert it names is a rule of ops/prometheus/rules/phasegate.yml;
every ```sql block runs (psql's ``:'request_id'`` and ``:'since'`` bound), and together
they return the section's incident request; every ``$ phasegate …`` line runs (with
``REQUEST_ID`` standing for that request) and exits 0, and a replay prints the request
with "no divergence". The queries marked as docs/audit.md's must be found there verbatim.
"""

from __future__ import annotations

import re
import shlex
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from app.store.embedded import EmbeddedPostgres
from tests.app.incident.conftest import Runner, _runner
from tests.ops.incident_log import KINDS, record_incidents
from tests.support.audit import fetch_sql

ROOT = Path(__file__).resolve().parents[2]
RUNBOOK = ROOT / "docs" / "runbook.md"
AUDIT = ROOT / "docs" / "audit.md"
RULES = ROOT / "ops" / "prometheus" / "rules" / "phasegate.yml"

pytestmark = pytest.mark.slow


def sections() -> dict[str, str]:
    """The incident kinds' sections: those before "# Planned changes", the page's second part."""
    incidents = RUNBOOK.read_text().split("\n# Planned changes\n", 1)[0]
    parts = re.split(r"^## (.+)$", incidents, flags=re.M)
    return {title.strip().lower(): text for title, text in zip(parts[1::2], parts[2::2], strict=True)}


def sql_blocks(text: str) -> list[str]:
    return re.findall(r"```sql\n(.*?)```", text, flags=re.S)


def commands(text: str) -> list[list[str]]:
    found = []
    for block in re.findall(r"```console\n(.*?)```", text, flags=re.S):
        found += [shlex.split(line[2:]) for line in block.splitlines() if line.startswith("$ ")]
    return found


def alerts(text: str) -> set[str]:
    (line,) = [line for line in text.splitlines() if line.startswith("**Alert**")]
    return set(re.findall(r"`(Phasegate\w+)`", line))


def normalized(sql: str) -> str:
    return " ".join(sql.split())


def bind(sql: str, values: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """psql's ``:'name'`` variables as bound parameters."""
    return re.sub(r":'(\w+)'", r":\1", sql), {name: values[name] for name in re.findall(r":'(\w+)'", sql)}


def test_the_runbook_covers_every_incident_kind_with_an_alert_sql_and_commands() -> None:
    found = sections()
    assert set(found) == set(KINDS)
    rules = {rule["alert"] for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]}
    audit = {normalized(sql) for sql in sql_blocks(AUDIT.read_text())}
    for kind, text in found.items():
        assert alerts(text) <= rules, f"{kind}: {alerts(text) - rules} is not an alert rule"
        assert "**Alert**: none" in text or alerts(text), kind
        assert sql_blocks(text) and commands(text), kind
        assert "**What to do**" in text, kind
        # a block said to be docs/audit.md's is that query, word for word
        cited = re.findall(r"docs/audit\.md, query (\d+)", text)
        if cited:
            assert any(normalized(sql) in audit for sql in sql_blocks(text)), kind
    assert normalized(sql_blocks(found["partition"])[1]) in audit  # query 9, verbatim


def test_every_query_and_command_of_the_runbook_explains_its_incident(
    database_url: str,
    postgres_server: EmbeddedPostgres | None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    incidents = record_incidents(database_url, postgres_server, tmp_path, monkeypatch)
    assert set(KINDS) <= set(incidents)
    monkeypatch.setenv("DATABASE_URL", database_url)
    monkeypatch.chdir(tmp_path)
    phasegate: Runner = _runner(capsys)
    for kind, text in sections().items():
        request_id = incidents[kind]
        values = {"request_id": request_id, "since": datetime(2026, 1, 1, tzinfo=UTC)}
        rows: list[dict[str, Any]] = []
        for sql in sql_blocks(text):
            statement, params = bind(sql, values)
            rows += fetch_sql(database_url, statement, **params)
        assert any(row.get("request_id") == request_id for row in rows), f"{kind}: the SQL misses {request_id}"
        if kind == "gateway lost":  # query 16: the dead instance, swept by the survivor
            assert any(row.get("swept_by") and row["requests_swept"] >= 1 for row in rows), rows
        for argv in commands(text):
            assert argv[0] == "phasegate", argv
            argv = [request_id if arg == "REQUEST_ID" else arg for arg in argv[1:]]
            ran = phasegate(*argv)
            assert ran.status == 0, f"{kind}: phasegate {' '.join(argv)} exited {ran.status}:\n{ran.out}{ran.err}"
            if argv[0] == "replay":
                assert "no divergence" in ran.out or "diverged: 0" in ran.out, ran.out
                if request_id in argv:
                    assert f"request {request_id}" in ran.out

    # what each incident's request says, as the runbook tells it
    def row(kind: str) -> dict[str, Any]:
        (found,) = fetch_sql(database_url, "SELECT * FROM requests WHERE request_id = :id", id=incidents[kind])
        return found

    assert row("replica dead")["attempts"] == 2 and row("replica dead")["outcome"] == "completed"
    assert row("replica dead, after the first delta")["error_code"] == "upstream_decode_interrupted"
    assert row("overload")["error_code"] == "retry_budget_exhausted"
    assert row("client gone")["error_code"] == "client_gone"
    assert row("gateway lost")["error_code"] == "gateway_lost"
    assert row("log outage")["error_code"] == "event_log_unavailable"
    assert row("poison request")["outcome"] == "failed" and row("poison request")["attempts"] == 2
