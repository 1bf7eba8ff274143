"""``phasegate replay``: from a trace file offline, from the log by id, and many by selection."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from ops import traces
from statemachine import events as ev
from statemachine.policy import POLICY_VERSION
from statemachine.trace import dump_trace
from tests.app.incident.conftest import Runner
from tests.statemachine.model import ModelDriver

ROOT = Path(__file__).resolve().parents[3]
TRACES = ROOT / "tests" / "traces"
DIVERGENT = TRACES / "divergent_soft_timeout_migrated.jsonl"


def test_a_trace_replays_offline_as_a_timeline_and_a_verdict(offline: Runner) -> None:
    ran = offline("replay", str(TRACES / "fence_released_by_lease_expiry.jsonl"))
    assert ran.status == 0, ran.err
    heading, *rows = ran.out.splitlines()
    assert heading.split() == ["time", "+ms", "phase", "att", "replica", "event", "decision"]
    assert any("AttemptFenced" in row and "fenced" in row and "w1" in row for row in rows)
    assert any("AttemptReleased because lease_expired" in row for row in rows)
    assert any("start_attempt(liveness_uncertain) attempt=2 exclude_replicas=[w1]" in row for row in rows)
    assert rows[-1] == "no divergence"


def test_the_real_entry_point_names_the_divergence_and_exits_1() -> None:
    ran = subprocess.run(
        [sys.executable, "-m", "app.cli", "replay", "-"],
        input=DIVERGENT.read_text(),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "DATABASE_URL": "postgresql://nobody@127.0.0.1:9/nothing"},
    )
    assert ran.returncode == 1, ran.stderr
    (marked,) = [line for line in ran.stdout.splitlines() if "DIVERGES" in line]
    assert "fence_attempt(overloaded)" in marked and "recomputed wait(overloaded_soft_timeout)" in marked
    assert "first divergence at seq 5:" in ran.stdout
    assert "  recorded:   fence_attempt(overloaded) attempt=1 wait_for=cancel_ack_or_lease_expiry" in ran.stdout
    assert "  recomputed: wait(overloaded_soft_timeout) attempt=1" in ran.stdout


def test_a_request_replays_from_the_log(phasegate: Runner, seed: Callable[..., None]) -> None:
    seed([traces.fenced_then_retried("req_fenced").events, traces.completed("req_done").events])
    ran = phasegate("replay", "req_fenced", "req_done")
    assert ran.status == 0, ran.err
    assert ran.out.count("no divergence") == 2
    assert any(row.split()[4:6] == ["w3", "FirstDeltaCommitted"] for row in ran.out.splitlines())
    quiet = phasegate("replay", "-q", "req_fenced")
    assert quiet.out.splitlines() == [
        f"request req_fenced: 15 events, 3 decisions (recorded by policy {POLICY_VERSION};"
        " replayed with max_attempts=2, retry_max_prompt_tokens=None)",
        "no divergence",
    ]


def test_an_unknown_request_is_named(phasegate: Runner) -> None:
    ran = phasegate("replay", "req_nobody")
    assert ran.status == 2 and "no such request in the log: req_nobody" in ran.err


def budget_spent_trace(tmp_path: Path) -> Path:
    """A request that failed after two replicas exited: what would a third attempt have done?"""
    driver = ModelDriver("req_budget")
    driver.fail(ev.FailureKind.REPLICA_EXITED)
    driver.fail(ev.FailureKind.REPLICA_EXITED)
    path = tmp_path / "budget.jsonl"
    path.write_text("".join(dump_trace(driver.events)))
    return path


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("policy.toml", "max_attempts = 3\n"),
        ("gateway.toml", "port = 8000\n\n[policy]\nmax_attempts = 3\n"),
        ("policy.json", '{"max_attempts": 3, "retry_max_prompt_tokens": null}'),
    ],
)
def test_another_policy_shows_where_its_decisions_would_differ(
    offline: Runner, tmp_path: Path, name: str, content: str
) -> None:
    trace = budget_spent_trace(tmp_path)
    assert offline("replay", str(trace)).status == 0
    (tmp_path / name).write_text(content)
    ran = offline("replay", str(trace), "--policy", str(tmp_path / name))
    assert ran.status == 1
    assert "replayed with max_attempts=3" in ran.out
    assert "recorded:   fail_request(retry_budget_exhausted)" in ran.out
    assert "recomputed: start_attempt(replica_exited) attempt=3 exclude_replicas=[w1,w2]" in ran.out


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("max_atempts = 3\n", "unknown policy settings: max_atempts"),
        ("max_attempts = 0\n", "max_attempts must be at least 1"),
        ('max_attempts = "3"\n', "must be an integer"),
        ("max_attempts = \n", "cannot read the policy"),
    ],
)
def test_a_bad_policy_file_is_refused(offline: Runner, tmp_path: Path, content: str, message: str) -> None:
    (tmp_path / "policy.toml").write_text(content)
    ran = offline("replay", str(TRACES / "clean_completion.jsonl"), "--policy", str(tmp_path / "policy.toml"))
    assert ran.status == 2 and message in ran.err and ran.out == ""


def test_arguments_that_say_nothing_or_too_much_are_refused(offline: Runner) -> None:
    assert "what to replay?" in offline("replay").err
    both = offline("replay", "req_x", "--since", "2026-11-30")
    assert both.status == 2 and "not both" in both.err
    with pytest.raises(SystemExit):
        offline("replay", "--since", "yesterday")


NIGHT = datetime(2026, 11, 30, 1, tzinfo=UTC)


def test_a_night_replays_by_selection_with_progress_and_a_summary(phasegate: Runner, seed: Callable[..., None]) -> None:
    seed(
        [
            traces.completed("req_before", at=NIGHT - timedelta(hours=2)).events,
            traces.completed("req_ok", at=NIGHT).events,
            traces.interrupted_in_decode("req_cut", at=NIGHT + timedelta(minutes=1)).events,
            traces.retried_before_first_delta("req_retried", at=NIGHT + timedelta(minutes=2)).events,
            traces.completed("req_other_model", at=NIGHT + timedelta(minutes=3), model="big").events,
        ]
    )
    assert phasegate("trace", "import", str(DIVERGENT)).status == 0  # accepted 2026-11-30T12:00
    ran = phasegate("replay", "--since", "2026-11-30T00:00")
    assert ran.status == 1
    assert "replaying 5 requests with the defaults and each request's recorded max_attempts" in ran.err
    assert "replayed 5/5 requests" in ran.err  # the progress, a line per tenth off a terminal
    summary = ran.out.splitlines()
    assert summary[0].startswith("replayed 5 requests, ") and "events/s; replay alone" in summary[0]
    assert summary[1] == "diverged: 1, broken: 0"
    assert summary[2].startswith("  diverged req_divergent at seq 5: recorded fence_attempt(overloaded)")
    narrowed = phasegate("replay", "--since", "2026-11-30T00:00", "--until", "2026-11-30T02:00", "--outcome", "failed")
    assert narrowed.status == 0 and narrowed.out.startswith("replayed 1 request, ")
    by_model = phasegate("replay", "--since", "2026-11-29", "--model", "tiny-llm", "--limit", "2")
    assert by_model.status == 0 and by_model.out.startswith("replayed 2 requests, ")
    none = phasegate("replay", "--since", "2031-01-01")
    assert none.status == 0 and none.out.startswith("replayed 0 requests")
