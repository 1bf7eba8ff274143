"""Where the next attempt goes after one failed before any output.

The policy (:mod:`statemachine.policy`) calls these with the pool's snapshot; the
placement itself is :func:`statemachine.routing.place`. In order:

- a 429 whose ``Retry-After`` is at most ``retry_same_max_wait_s``, or one server
  error, is retried on the same replica once the wait is over (``WaitToRetry``, then
  the ``RetryWaitElapsed`` timer), unless another replica is healthier: available and
  no more loaded;
- otherwise the attempt fails over to a replica of the model not tried yet, and the
  placement says why;
- once the model's own attempts (``max_attempts``) are spent, or no replica of it is
  left, the request's ``fallbacks`` are tried in order; a ``context_length_exceeded``
  or content-policy refusal tries its own list at once. Never after the first
  delivered delta: the policy calls none of this in decode.
"""

from __future__ import annotations

from statemachine.actions import Action, FailRequest, StartAttempt, WaitToRetry, fail_before_output
from statemachine.events import FailureKind
from statemachine.policy_config import PolicyConfig
from statemachine.request_state import AttemptState, RequestState
from statemachine.routing import PoolSnapshot, least_loaded, place

MODEL_FALLBACK = "model_fallback"  # a StartAttempt's migration onto a fallback model
# Refusals with fallback lists of their own (routing.RoutingConfig): OpenAI's codes
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
CONTENT_POLICY_CODES = frozenset({"content_policy_violation", "content_filter"})


def retry_or_fail(
    state: RequestState, source: AttemptState, config: PolicyConfig, pool: PoolSnapshot | None
) -> list[Action]:
    """After an attempt that failed before any output: the next one (on the same replica
    after its wait, on another, or on a fallback model), or the request's failure."""
    used = state.attempts_on(source.model)
    if used >= config.max_attempts:
        chosen = fallback(state, config, pool, state.routing.fallbacks, "its retries were spent")
        if chosen is not None:
            return [chosen]
        return [
            fail_before_output(
                "retry_budget_exhausted",
                code="upstream_unavailable",
                message=f"all {len(state.attempts)} attempts failed before any output was sent",
                http_status=502,
            )
        ]
    guard = _cost_guard(state, config)
    if guard is not None:
        return [guard]
    migration = "new_request" if source.failure is FailureKind.REJECTED else "prefill_retry"
    reason = source.failure.value if source.failure is not None else (source.ended or "attempt_lost")
    same, why = _same_replica(state, source, pool, reason, migration)
    if same is not None:
        return [same]
    return [start(state, pool, reason, migration=migration, model=source.model, why=why)]


def start(
    state: RequestState,
    pool: PoolSnapshot | None,
    reason: str,
    *,
    migration: str | None,
    model: str | None = None,
    why: str = "",
) -> StartAttempt:
    """The next attempt of ``model`` (the request's by default), placed on a replica it
    did not try yet; with no pool given (a log written before placements were
    recorded) the placement is left out."""
    model = model or state.model
    tried = tuple(sorted({a.replica_id for a in state.attempts if a.model == model}))
    attempt = len(state.attempts) + 1
    if pool is None:
        return StartAttempt(reason, attempt, tried, migration, model=model)
    placement = place(pool, model, tried, state.routing, state.affinity_key)
    placed = f"{why}; {placement.why}" if why else placement.why
    return StartAttempt(reason, attempt, tried, migration, placement.replica, model, placed, pool)


def _same_replica(
    state: RequestState, source: AttemptState, pool: PoolSnapshot | None, reason: str, migration: str
) -> tuple[Action | None, str]:
    """A retry on the replica that just failed, after its ``Retry-After``: for a 429
    advising at most ``retry_same_max_wait_s``, or one server error, when no other
    replica is healthier (available, and no more loaded). Else ``None``, and why the
    attempt fails over instead."""
    max_wait = state.routing.retry_same_max_wait_s
    wait = source.retry_after_s or 0.0
    if pool is None or not (source.upstream_status == 429 or source.server_error):
        return None, ""
    if source.upstream_status == 429 and source.retry_after_s is None:
        return None, "failover: the 429 gave no Retry-After"
    if wait > max_wait:
        return None, f"failover: Retry-After {wait:g}s is over retry_same_max_wait_s {max_wait:g}s"
    replica = source.replica_id
    view = pool.view(replica)
    if state.waited_for != replica:
        tried = set(state.replicas_tried)
        others = [v for v in pool.replicas if v.serves(source.model) and v.takes_new and v.id not in tried]
        if view is None:
            return None, f"failover: {replica} left the pool"
        if others and (better := least_loaded(others)).load <= view.load:
            return None, f"failover: {better.id} is available and no more loaded than {replica}"
        if wait > 0:
            return WaitToRetry(reason, source.attempt, replica, wait, pool), ""
    if view is None or not view.takes_new:
        return None, f"failover: {replica} is not available after the wait"
    exclude = tuple(sorted(set(state.replicas_tried) - {replica}))
    attempt = len(state.attempts) + 1
    placement = f"same replica: no other is healthier (waited {wait:g}s)"
    return StartAttempt(reason, attempt, exclude, migration, replica, source.model, placement, pool), ""


def fallback(
    state: RequestState, config: PolicyConfig, pool: PoolSnapshot | None, chain: tuple[str, ...], after: str
) -> Action | None:
    """The first model of ``chain`` not tried yet that a replica can take, or ``None``."""
    if pool is None or not chain:
        return None
    guard = _cost_guard(state, config)
    tried = {attempt.model for attempt in state.attempts}
    for model in chain:
        if model in tried:
            continue
        placement = place(pool, model, (), state.routing, state.affinity_key)
        if placement.replica is not None:
            if guard is not None:
                return guard
            why = f"fallback from {state.model} after {after}; {placement.why}"
            attempt = len(state.attempts) + 1
            return StartAttempt("model_fallback", attempt, (), MODEL_FALLBACK, placement.replica, model, why, pool)
    return None


def _cost_guard(state: RequestState, config: PolicyConfig) -> FailRequest | None:
    limit = config.retry_max_prompt_tokens
    if limit is None or state.prompt_tokens <= limit:
        return None
    return fail_before_output(
        "retry_cost_guard",
        code="retry_cost_exceeded",
        message=f"a retry would prefill {state.prompt_tokens} prompt tokens, over the limit {limit}",
        http_status=503,
    )
