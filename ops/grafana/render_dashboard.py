"""Render the Grafana dashboard (ops/grafana/dashboards/phasegate.json) from the panels below.

    python -m ops.grafana.render_dashboard          # rewrite the JSON
    python -m ops.grafana.render_dashboard --check  # exit 1 if the JSON is stale

The panels are data: a title, a unit and PromQL expressions over the metrics that the
gateway (app/telemetry/metrics.py) and the workers (app/worker/metrics.py) export.
tests/ops/test_dashboard.py fails when the checked-in JSON differs from this rendering,
or when an expression names a metric that a live gateway and worker do not export.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "dashboards" / "phasegate.json"
RATE = "$__rate_interval"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    targets: tuple[tuple[str, str], ...]  # (legend, expression)
    description: str = ""
    kind: str = "timeseries"


def quantiles(histogram: str, by: str = "") -> tuple[tuple[str, str], ...]:
    labels = f"le, {by}" if by else "le"
    legend = f"{{{{{by}}}}} " if by else ""
    return tuple(
        (f"{legend}p{q}", f"histogram_quantile(0.{q}, sum by ({labels}) (rate({histogram}_bucket[{RATE}])))")
        for q in ("50", "90", "99")
    )


ROWS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    (
        "Requests",
        (
            Panel(
                "Requests by outcome",
                "reqps",
                (("{{outcome}}", f"sum by (outcome) (rate(phasegate_requests_total[{RATE}]))"),),
                "Finished requests per second, by their terminal outcome.",
            ),
            Panel(
                "Refused before acceptance",
                "reqps",
                (("{{code}}", f"sum by (code) (rate(phasegate_requests_rejected_total[{RATE}]))"),),
                "Requests refused by validation, authentication or admission, by error code.",
            ),
            Panel(
                "Open requests by phase",
                "short",
                (("{{phase}}", "sum by (phase) (phasegate_requests_open)"),),
                "Non-terminal requests by phase, over every gateway instance (each reports those it drives).",
            ),
            Panel(
                "Requests in flight by instance",
                "short",
                (("{{instance}}", "sum by (instance) (phasegate_requests_in_flight)"),),
            ),
        ),
    ),
    (
        "Failover",
        (
            Panel(
                "Migrations by type",
                "ops",
                (("{{migration_type}}", f"sum by (migration_type) (rate(phasegate_migration_total[{RATE}]))"),),
                "Attempts re-run on another replica before the first delta reached the client.",
            ),
            Panel(
                "Interrupted streams",
                "ops",
                (("{{model}}", f"sum by (model) (rate(phasegate_decode_interrupted_total[{RATE}]))"),),
                "Streams ended by upstream_decode_interrupted: the failure after the first delta.",
            ),
            Panel(
                "Replicas ejected",
                "short",
                (("{{replica}}", "count by (replica) (phasegate_replica_healthy == 0)"),),
                "For each ejected replica, how many gateway instances have it out of the pool.",
            ),
            Panel(
                "Retry budget",
                "short",
                (
                    ("available", "sum(phasegate_retry_budget_available)"),
                    ("denied/s", f"sum(rate(phasegate_retry_budget_denied_total[{RATE}]))"),
                    (
                        "fenced/s {{released_by}}",
                        f"sum by (released_by) (rate(phasegate_fenced_attempts_total[{RATE}]))",
                    ),
                ),
                "Retries the global budget allows now (each instance holds its share), and retries it refused.",
            ),
        ),
    ),
    (
        "Latency",
        (
            Panel(
                "Time to first token",
                "s",
                quantiles("phasegate_time_to_first_token_seconds"),
                "Acceptance to the first delta written to the client.",
            ),
            Panel(
                "Inter-token latency",
                "s",
                quantiles("phasegate_inter_token_latency_seconds"),
                "Gap between deltas written to the client.",
            ),
        ),
    ),
    (
        "Event log",
        (
            Panel(
                "Log append latency",
                "s",
                quantiles("phasegate_eventlog_append_seconds", by="durable"),
                "Appends as the driver waits for them; durable: awaited to commit.",
            ),
            Panel(
                "Group-commit batch size",
                "short",
                (
                    *quantiles("phasegate_eventlog_group_commit_events"),
                    (
                        "mean",
                        f"sum(rate(phasegate_eventlog_group_commit_events_sum[{RATE}]))"
                        f" / sum(rate(phasegate_eventlog_group_commit_events_count[{RATE}]))",
                    ),
                ),
                "Events per group-committed transaction.",
            ),
        ),
    ),
    (
        "Instances and workers",
        (
            Panel(
                "Gateway instances",
                "short",
                (
                    ("live", "max(phasegate_gateway_instances)"),
                    ("swept", f"sum(increase(phasegate_gateway_instances_swept_total[{RATE}]))"),
                ),
                "Instances whose lease is live in the log, and lapsed ones swept by the living.",
            ),
            Panel(
                "Worker tokens per second",
                "short",
                (("{{worker}}", "sum by (worker) (phasegate_worker_tokens_per_second)"),),
            ),
            Panel(
                "Worker slots",
                "short",
                (
                    ("running {{worker}}", "sum by (worker) (phasegate_worker_running)"),
                    ("queued {{worker}}", "sum by (worker) (phasegate_worker_queued)"),
                ),
                "Attempts holding an engine slot, and admitted attempts waiting for one.",
            ),
        ),
    ),
)


def render() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    y = 0
    for row_title, row in ROWS:
        panels.append(
            {
                "type": "row",
                "title": row_title,
                "id": len(panels) + 1,
                "collapsed": False,
                "panels": [],
                "gridPos": {"x": 0, "y": y, "w": 24, "h": 1},
            }
        )
        y += 1
        width = 24 // len(row)
        for index, panel in enumerate(row):
            panels.append(_panel(panel, len(panels) + 1, {"x": index * width, "y": y, "w": width, "h": 8}))
        y += 8
    return {
        "title": "phasegate",
        "uid": "phasegate",
        "tags": ["phasegate"],
        "timezone": "utc",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                    "refresh": 1,
                }
            ]
        },
        "annotations": {"list": []},
        "panels": panels,
    }


def _panel(panel: Panel, panel_id: int, grid: dict[str, int]) -> dict[str, Any]:
    return {
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "id": panel_id,
        "gridPos": grid,
        "datasource": DATASOURCE,
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True}},
        "targets": [
            {"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend}
            for i, (legend, expr) in enumerate(panel.targets)
        ],
    }


def rendered_text() -> str:
    return json.dumps(render(), indent=2) + "\n"


def main(argv: list[str]) -> int:
    if "--check" in argv:
        stale = not OUT.exists() or OUT.read_text() != rendered_text()
        if stale:
            print(f"{OUT} is stale: run python -m ops.grafana.render_dashboard")
        return int(stale)
    OUT.write_text(rendered_text())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
