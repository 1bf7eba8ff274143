"""Prometheus metrics of one worker, read from its counters at scrape time.

The token loop only increments plain integers (``WorkerStats``); this collector turns
them into metric families when /metrics is scraped, so no metric lock sits on the
per-token path. ``tokens_per_second`` is the generation rate over the last ten
seconds, sampled by the worker's housekeeping loop. A vLLM engine's own metrics
(``vllm:*``: its prefix-cache queries and hits, its queue, its KV-cache use), which
vLLM registers in prometheus_client's global registry, are served beside them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator

from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from app.worker.worker import Worker

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class TokenRate:
    """Tokens per second over a sliding window of samples."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, int]] = deque()

    def sample(self, total_tokens: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._samples.append((now, total_tokens))
        while len(self._samples) > 2 and now - self._samples[0][0] > self.window_s:
            self._samples.popleft()

    def per_second(self) -> float:
        if len(self._samples) < 2:
            return 0.0
        (t0, n0), (t1, n1) = self._samples[0], self._samples[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0


class WorkerCollector(Collector):
    def __init__(self, worker: Worker, rate: TokenRate, worker_id: str) -> None:
        self.worker = worker
        self.rate = rate
        self.labels = {"worker": worker_id, "engine": worker.engine.name}

    def collect(self) -> Iterator[Metric]:
        w, s = self.worker, self.worker.stats
        names = list(self.labels)
        values = list(self.labels.values())

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(f"phasegate_worker_{name}", doc, labels=names)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(f"phasegate_worker_{name}", doc, labels=names)
            family.add_metric(values, value)
            return family

        yield gauge("running", "attempts holding an engine slot", w.running)
        yield gauge("queued", "admitted attempts waiting for an engine slot", w.queued)
        yield gauge("ready", "1 once the engine is loaded and the worker accepts attempts", int(w.ready))
        yield gauge("draining", "1 while shutting down", int(w.draining))
        yield gauge("tokens_per_second", "tokens generated per second, last 10 s", self.rate.per_second())
        yield counter("attempts_started", "attempts admitted", s.started)
        yield counter("attempts_finished", "attempts that published done", s.finished)
        yield counter("lease_expiries", "attempts stopped because their lease lapsed", s.lease_expiries)
        yield counter("renew_calls", "renew requests; a batched renew counts once", s.renew_calls)
        yield counter("leases_renewed", "leases extended", s.leases_renewed)
        yield counter("tokens_generated", "tokens the engine produced", s.tokens_generated)
        yield counter("tokens_published", "tokens written in token frames", s.tokens_published)
        yield counter("frames_published", "token and tool_call frames written", s.frames_published)
        aborted = CounterMetricFamily(
            "phasegate_worker_attempts_aborted",
            "attempts stopped early, by reason",
            labels=[*names, "reason"],
        )
        for reason, count in sorted(s.stopped.items()):
            aborted.add_metric([*values, str(reason)], count)
        yield aborted
        rejected = CounterMetricFamily(
            "phasegate_worker_rejections", "start requests refused, by code", labels=[*names, "code"]
        )
        for code, count in sorted(s.rejected.items()):
            rejected.add_metric([*values, str(code)], count)
        yield rejected


class EngineCollector(Collector):
    """The engine's own metric families: vLLM's, from the global registry (none for the sim)."""

    def collect(self) -> Iterator[Metric]:
        for metric in REGISTRY.collect():
            if metric.name.startswith(ENGINE_METRICS_PREFIX):
                yield metric


ENGINE_METRICS_PREFIX = "vllm:"


def make_registry(worker: Worker, rate: TokenRate, worker_id: str) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WorkerCollector(worker, rate, worker_id))
    registry.register(EngineCollector())
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
