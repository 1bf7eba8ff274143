"""The Grafana dashboard: rendered from ops/grafana/render_dashboard.py, well formed, showing
what an operator needs to see (``WANTED``), and provisioned by compose.yaml."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from ops.grafana.render_dashboard import OUT, rendered_text
from tests.ops.promql import metric_names

REPO = Path(__file__).resolve().parents[2]
# what an operator needs the dashboard to show, and a metric that shows it
WANTED = {
    "requests by outcome": "phasegate_requests_total",
    "migrations by type": "phasegate_migration_total",
    "interrupted streams": "phasegate_decode_interrupted_total",
    "TTFT quantiles": "phasegate_time_to_first_token_seconds_bucket",
    "inter-token latency quantiles": "phasegate_inter_token_latency_seconds_bucket",
    "log append latency": "phasegate_eventlog_append_seconds_bucket",
    "group-commit batch size": "phasegate_eventlog_group_commit_events_bucket",
    "replicas ejected": "phasegate_replica_healthy",
    "retry budget": "phasegate_retry_budget_available",
    "open requests by phase": "phasegate_requests_open",
    "gateway instances": "phasegate_gateway_instances",
}


def dashboard() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(OUT.read_text())
    return document


def expressions() -> list[str]:
    return [target["expr"] for panel in dashboard()["panels"] for target in panel.get("targets", [])]


def test_the_checked_in_json_is_the_rendering() -> None:
    assert OUT.read_text() == rendered_text(), "stale: run python -m ops.grafana.render_dashboard"


def test_the_dashboard_shows_what_the_issue_lists() -> None:
    named = set().union(*map(metric_names, expressions()))
    missing = {topic: metric for topic, metric in WANTED.items() if metric not in named}
    assert missing == {}
    assert any("by (outcome)" in e for e in expressions()) and any("by (phase)" in e for e in expressions())
    assert any("by (migration_type)" in e for e in expressions())


def test_panels_are_well_formed() -> None:
    document = dashboard()
    variables = {variable["name"] for variable in document["templating"]["list"]}
    panels = document["panels"]
    assert len({panel["id"] for panel in panels}) == len(panels)
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24 and grid["h"] > 0
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"].strip("${}") in variables
        refs = [target["refId"] for target in panel["targets"]]
        assert refs and len(set(refs)) == len(refs), panel["title"]
        assert all(target["expr"].count("(") == target["expr"].count(")") for target in panel["targets"])


def test_compose_provisions_the_dashboard_and_its_datasource() -> None:
    grafana = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]["grafana"]
    mounts = dict(volume.split(":")[:2] for volume in grafana["volumes"])
    provisioning = REPO / mounts["./ops/grafana/provisioning"].replace(
        "/etc/grafana/provisioning", "ops/grafana/provisioning"
    )
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "phasegate.yaml").read_text())["providers"]
    assert mounts["./ops/grafana/dashboards"] == provider["options"]["path"]
    assert (REPO / "ops/grafana/dashboards" / OUT.name).is_file()
    (datasource,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())["datasources"]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"].endswith(OUT.name)
