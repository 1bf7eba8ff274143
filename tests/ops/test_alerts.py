"""The alert rules: `promtool check rules`, `promtool test rules` with a case per alert, and
the Kubernetes PrometheusRule carrying the same groups.

promtool comes from Debian's `prometheus` package (`.ci/promtool` installs it). Without it
these tests skip, unless PHASEGATE_REQUIRE_PROMTOOL is set (as `.ci/run` does).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "ops" / "prometheus" / "rules" / "phasegate.yml"
RULE_TESTS = REPO / "ops" / "prometheus" / "tests" / "phasegate_test.yml"
# what an operator needs an alert for, and the alert that answers it
WANTED = {
    "interrupted-stream rate": "PhasegateStreamsInterrupted",
    "retry budget exhausted": "PhasegateRetryBudgetExhausted",
    "all replicas of a model ejected": "PhasegateModelWithoutReplica",
    "log append p99 over 50 ms": "PhasegateLogAppendSlow",
    "requests non-terminal for longer than 10 minutes": "PhasegateRequestsStuck",
    "a gateway instance swept": "PhasegateGatewaySwept",
}


def promtool() -> str:
    found = os.environ.get("PHASEGATE_PROMTOOL") or shutil.which("promtool")
    if found:
        return found
    why = "promtool is missing (.ci/promtool installs Debian's prometheus package)"
    if os.environ.get("PHASEGATE_REQUIRE_PROMTOOL"):
        pytest.fail(why + "; PHASEGATE_REQUIRE_PROMTOOL forbids skipping")
    pytest.skip(why)


def run(*args: str | Path, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=120)


def alerts() -> dict[str, dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {rule["alert"]: rule for group in groups for rule in group["rules"]}


def test_every_alert_the_issue_asks_for_exists() -> None:
    assert set(WANTED.values()) == set(alerts())


def test_promtool_check_rules() -> None:
    result = run("check", "rules", RULES)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in result.stdout


def test_promtool_check_rules_refuses_a_broken_rule(tmp_path: Path) -> None:
    broken = yaml.safe_load(RULES.read_text())
    broken["groups"][0]["rules"][0]["expr"] = "sum by (model) (rate(phasegate_requests_total[5m]"
    (tmp_path / "broken.yml").write_text(yaml.safe_dump(broken))
    result = run("check", "rules", tmp_path / "broken.yml")
    assert result.returncode != 0 and "parse error" in (result.stdout + result.stderr)


def test_promtool_test_rules() -> None:
    result = run("test", "rules", RULE_TESTS)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_firing_case_and_a_quiet_one() -> None:
    cases = [case for test in yaml.safe_load(RULE_TESTS.read_text())["tests"] for case in test["alert_rule_test"]]
    for alert in alerts():
        assert any(c["alertname"] == alert and c["exp_alerts"] for c in cases), f"{alert} never fires in a test"
        assert any(c["alertname"] == alert and not c["exp_alerts"] for c in cases), f"{alert} is never held quiet"


def test_the_unit_tests_can_fail(tmp_path: Path) -> None:
    """An alert whose threshold moved is caught by its unit test."""
    moved = RULES.read_text().replace("> 0.05", "> 0.5")  # log append p99 over 500 ms instead
    assert moved != RULES.read_text()
    (tmp_path / "rules").mkdir()
    (tmp_path / "rules" / "phasegate.yml").write_text(moved)
    (tmp_path / "tests").mkdir()
    shutil.copy(RULE_TESTS, tmp_path / "tests" / RULE_TESTS.name)
    result = run("test", "rules", tmp_path / "tests" / RULE_TESTS.name)
    assert result.returncode != 0 and "PhasegateLogAppendSlow" in result.stdout + result.stderr


def test_the_kubernetes_prometheusrule_carries_the_same_groups() -> None:
    document = yaml.safe_load((REPO / "deploy" / "kubernetes" / "prometheusrule.yaml").read_text())
    assert document["kind"] == "PrometheusRule"
    assert document["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]
