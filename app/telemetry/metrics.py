"""The gateway's Prometheus metrics, on a registry of their own (one per app)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TOKEN_GAP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
APPEND_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._requests(self.registry)
        self._latencies(self.registry)
        self._replicas(self.registry)
        self._live_state(self.registry)
        self._fleet(self.registry)
        # called before each scrape is rendered, to set the gauges of the live state
        self.on_scrape: Callable[[], None] = lambda: None

    def _requests(self, r: CollectorRegistry) -> None:
        """Requests and what became of them: outcomes, refusals, migrations, fences."""
        self.requests = Counter("phasegate_requests", "Requests by model and outcome", ["model", "outcome"], registry=r)
        self.rejected = Counter(
            "phasegate_requests_rejected", "Requests refused before acceptance, by error code", ["code"], registry=r
        )
        self.migrations = Counter(
            "phasegate_migration",
            "Attempts re-run on another replica before the first delta",
            ["model", "migration_type"],
            registry=r,
        )
        self.cost_guard = Counter(
            "phasegate_migration_max_seq_len_exceeded",
            "Retries refused by the cost guard (prompt over the retry limit)",
            ["model"],
            registry=r,
        )
        self.decode_interruptions = Counter(
            "phasegate_decode_interrupted", "Streams ended by upstream_decode_interrupted", ["model"], registry=r
        )
        self.fences = Counter(
            "phasegate_fenced_attempts", "Fenced attempts by how they were released", ["released_by"], registry=r
        )

    def _latencies(self, r: CollectorRegistry) -> None:
        """What the client waited for, and what the log's appends took."""
        self.ttft = Histogram(
            "phasegate_time_to_first_token_seconds",
            "Acceptance to the first delta written to the client",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token = Histogram(
            "phasegate_inter_token_latency_seconds",
            "Gap between deltas written to the client",
            ["model"],
            buckets=TOKEN_GAP_BUCKETS,
            registry=r,
        )
        self.attempts = Histogram(
            "phasegate_attempts_per_request", "Attempts per finished request", buckets=(1, 2, 3, 4, 5), registry=r
        )
        self.append_seconds = Histogram(
            "phasegate_eventlog_append_seconds",
            "Event-log appends as the driver waits for them",
            ["durable"],
            buckets=APPEND_BUCKETS,
            registry=r,
        )
        self.append_batch = Histogram(
            "phasegate_eventlog_group_commit_events",
            "Events per group-committed transaction",
            buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000),
            registry=r,
        )

    def _replicas(self, r: CollectorRegistry) -> None:
        """The pool's replicas, those DNS discovery declares, and the requests in flight."""
        self.replica_healthy = Gauge(
            "phasegate_replica_healthy", "1 while a replica is in the pool", ["replica"], registry=r
        )
        self.in_flight = Gauge("phasegate_requests_in_flight", "Requests being served", registry=r)
        # DNS discovery ([[discover]]): a failed resolution keeps the last known set
        self.discovery_failures = Counter(
            "phasegate_discovery_failures",
            "DNS discovery resolutions that failed, the last known set kept, by name",
            ["name"],
            registry=r,
        )
        self.discovered = Gauge(
            "phasegate_discovery_addresses",
            "Addresses a discovered name declares, as last resolved",
            ["name"],
            registry=r,
        )

    def _live_state(self, r: CollectorRegistry) -> None:
        """The gateway's live state, set at each scrape (on_scrape: app/driver/gauges.py)."""
        self.retry_budget_available = Gauge(
            "phasegate_retry_budget_available", "Retries the global retry budget allows now", registry=r
        )
        self.retry_budget_denied = Counter(
            "phasegate_retry_budget_denied", "Retries refused because the global retry budget was empty", registry=r
        )
        self.model_replicas_healthy = Gauge(
            "phasegate_model_replicas_healthy", "Replicas in the pool that serve a model", ["model"], registry=r
        )
        self.requests_open = Gauge(
            "phasegate_requests_open", "Non-terminal requests this gateway drives, by phase", ["phase"], registry=r
        )
        self.oldest_open_request = Gauge(
            "phasegate_requests_oldest_open_seconds",
            "Age of the oldest non-terminal request this gateway drives",
            registry=r,
        )
        self.gateway_instances = Gauge(
            "phasegate_gateway_instances", "Gateway instances whose lease is live in the log", registry=r
        )
        self.instances_swept = Counter(
            "phasegate_gateway_instances_swept",
            "Lapsed gateway instances this instance swept (their open requests closed)",
            registry=r,
        )
        self.instances_fenced = Counter(
            "phasegate_gateway_instance_fenced", "Times this gateway lost its lease and registered again", registry=r
        )

    def _fleet(self, r: CollectorRegistry) -> None:
        """The fleet (docs/design.md §16): members by model and state, set at each scrape;
        changes this process applied, by the source that made them."""
        self.model_replicas = Gauge(
            "phasegate_fleet_replicas",
            "Fleet members by model and state (serving, cordoned)",
            ["model", "state"],
            registry=r,
        )
        self.fleet_changes = Counter(
            "phasegate_fleet_changes",
            "Fleet events this process saw applied, by source and event",
            ["source", "event"],
            registry=r,
        )

    def forget_replica(self, replica_id: str) -> None:
        """A replica that left the fleet: its series go (no gauge stays at its last value)."""
        with contextlib.suppress(KeyError):
            self.replica_healthy.remove(replica_id)

    def render(self) -> bytes:
        self.on_scrape()
        return generate_latest(self.registry)
