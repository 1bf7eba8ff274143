"""Every expression in the dashboard and the alert rules names only metrics that a live
gateway and worker export: both are started (a real sim worker, a real gateway on the
real log), a request is served, and both /metrics pages are scraped."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import yaml

from ops.grafana.render_dashboard import OUT
from tests.ops.promql import exported_series, metric_names
from tests.support.gateway import MODEL, running_gateway
from tests.support.workers import running_worker

REPO = Path(__file__).resolve().parents[2]
RULE_FILES = [REPO / "ops/prometheus/rules/phasegate.yml", REPO / "deploy/kubernetes/prometheusrule.yaml"]


def expressions() -> dict[str, str]:
    """Every expression, keyed by where it is."""
    found = {
        f"dashboard {panel['title']!r} {target['refId']}": target["expr"]
        for panel in json.loads(OUT.read_text())["panels"]
        for target in panel.get("targets", [])
    }
    for path in RULE_FILES:
        document = yaml.safe_load(path.read_text())
        for group in document.get("spec", document)["groups"]:
            for rule in group["rules"]:
                found[f"{path.name} {rule['alert']}"] = rule["expr"]
    return found


def test_every_expression_names_exported_metrics(database_url: str) -> None:
    with running_worker() as worker, running_gateway(database_url, [worker]) as gateway:
        stream = gateway.openai().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hello"}], stream=True, max_tokens=8
        )
        assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        gateway.settle()
        with gateway.http() as http:
            gateway_page = http.get("/metrics").text
        worker_page = httpx.get(f"{worker.base_url}/metrics", timeout=10).text
    exported = exported_series(gateway_page) | exported_series(worker_page)
    assert "phasegate_worker_tokens_generated_total" in exported and "phasegate_requests_total" in exported
    unknown = {where: sorted(metric_names(expr) - exported) for where, expr in expressions().items()}
    assert {where: names for where, names in unknown.items() if names} == {}
    assert len(expressions()) >= 20
