"""The gauges that describe a gateway's live state, read from that state at each scrape.

Open requests by phase and the oldest one's age come from the requests this instance
drives (``GatewayContext.drivers``; a request that ended but still has a fence to
complete is not open); the retry budget from its bucket; healthy replicas per model from
the pool. Each instance reports its own: the dashboard sums them, the alerts take the
largest or the smallest.
"""

from __future__ import annotations

from app.driver.context import GatewayContext
from statemachine.phases import Phase

OPEN_PHASES = (Phase.PREFILL, Phase.DECODE, Phase.FENCED)


def sample(ctx: GatewayContext) -> None:
    """Set the live-state gauges of ``ctx.metrics`` to what ``ctx`` holds now."""
    metrics, now = ctx.metrics, ctx.clock()
    open_requests = [live for live in ctx.drivers.values() if live.state.phase is not Phase.TERMINATED]
    for phase in OPEN_PHASES:
        metrics.requests_open.labels(phase=phase.value).set(
            sum(1 for live in open_requests if live.state.phase is phase)
        )
    metrics.oldest_open_request.set(max((now - live.accepted_at for live in open_requests), default=0.0))
    metrics.retry_budget_available.set(ctx.budget.available)
    replicas = ctx.pool.replicas.values()
    models = set(ctx.config.models).union(*(replica.config.models for replica in replicas))
    for model in sorted(models):
        healthy = sum(1 for replica in replicas if replica.healthy is True and replica.config.serves(model))
        metrics.model_replicas_healthy.labels(model=model).set(healthy)
        for state, cordoned in (("serving", False), ("cordoned", True)):
            members = sum(1 for r in replicas if r.cordoned is cordoned and r.config.serves(model))
            metrics.model_replicas.labels(model=model, state=state).set(members)
