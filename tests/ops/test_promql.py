"""The metric-name finder the dashboard and alert tests rely on, on known expressions."""

from __future__ import annotations

from app.telemetry.metrics import Metrics
from tests.ops.promql import exported_series, metric_names


def test_names_are_found_and_everything_else_is_not() -> None:
    expression = (
        'histogram_quantile(0.99, sum by (le, durable) (rate(phasegate_eventlog_append_seconds_bucket{durable="true"}'
        "[$__rate_interval]))) > 0.05 and on (instance) phasegate_requests_in_flight offset 5m"
        ' or count by (replica) (phasegate_replica_healthy == bool 0) unless vector(1e3) / up{job=~"a|b"}'
    )
    assert metric_names(expression) == {
        "phasegate_eventlog_append_seconds_bucket",
        "phasegate_requests_in_flight",
        "phasegate_replica_healthy",
        "up",
    }


def test_a_misspelled_metric_is_not_exported() -> None:
    exported = exported_series(Metrics().render().decode())
    assert {"phasegate_requests_total", "phasegate_eventlog_append_seconds_bucket"} <= exported
    assert "phasegate_model_replicas_healthy" in exported  # labelled, no sample yet: still exported
    assert metric_names("rate(phasegate_request_total[5m])") - exported == {"phasegate_request_total"}
