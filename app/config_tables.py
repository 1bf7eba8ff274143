"""The tables of the gateway's settings, each checked as it is built: ``[limits]``,
``[tenant_limits]``, ``[[replicas]]``, ``[routing]``, ``[timeouts]``, and the error a
setting that cannot be used raises. app/config.py holds the settings whole and loads them
(and is where the rest of the gateway imports these from)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from statemachine.routing import DEFAULT_ROUTING, RoutingConfig


class ConfigError(ValueError):
    """A setting that cannot be used; the message names it."""


@dataclass(frozen=True, slots=True)
class Limits:
    """What one request may ask for, where the operator limits it more than the replica
    does (``None``: as the replica, vLLM, allows; docs/compatibility.md)."""

    max_tokens: int | None = None  # the most a request may ask for
    default_max_tokens: int | None = None  # sent for a request that does not say (None: the replica's default)
    max_n: int = 128  # choices a request may ask for

    def __post_init__(self) -> None:
        for name in ("max_tokens", "default_max_tokens", "max_n"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ConfigError(f"limits.{name} must be a whole number of at least 1")
        if self.max_tokens is not None and (self.default_max_tokens or 0) > self.max_tokens:
            raise ConfigError("limits.default_max_tokens must not exceed limits.max_tokens")


@dataclass(frozen=True, slots=True)
class TenantLimit:
    """One tenant's limits; ``None`` takes the default's, 0 is no limit."""

    concurrent_streams: int | None = None  # generation requests in flight, streamed or not
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None  # estimated prompt tokens at admission, output tokens as delivered

    def __post_init__(self) -> None:
        for name in ("concurrent_streams", "requests_per_minute", "tokens_per_minute"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 0):
                raise ConfigError(f"tenant_limits: {name} must be a whole number, 0 for no limit")

    def over(self, default: TenantLimit) -> TenantLimit:
        """This tenant's limits, each unset one taken from ``default``."""
        return TenantLimit(
            *(
                default_value if value is None else value
                for value, default_value in (
                    (self.concurrent_streams, default.concurrent_streams),
                    (self.requests_per_minute, default.requests_per_minute),
                    (self.tokens_per_minute, default.tokens_per_minute),
                )
            )
        )


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """Per-tenant limits: ``default`` for every tenant, ``tenants`` overriding it field by field."""

    default: TenantLimit = field(default_factory=TenantLimit)
    tenants: dict[str, TenantLimit] = field(default_factory=dict)

    def of(self, tenant: str) -> TenantLimit:
        own = self.tenants.get(tenant)
        return self.default if own is None else own.over(self.default)

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> TenantLimits:
        """``[tenant_limits]``'s keys are the defaults; ``[tenant_limits.tenants.NAME]`` a tenant's."""
        values = dict(values)
        tenants = values.pop("tenants", {})
        if not isinstance(tenants, dict) or not all(isinstance(v, dict) for v in tenants.values()):
            raise ConfigError("tenant_limits.tenants: a table per tenant")
        try:
            return cls(TenantLimit(**values), {name: TenantLimit(**limit) for name, limit in tenants.items()})
        except TypeError as exc:
            raise ConfigError(f"tenant_limits: {exc}") from None


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    id: str
    url: str
    kind: str = "worker"  # "worker": phasegate worker; "openai": any OpenAI-compatible server
    models: tuple[str, ...] = ()  # empty: every configured model
    # each model's revision where it says one ("NAME=REV"); others: the configured one (docs/design.md §16)
    revisions: tuple[tuple[str, str], ...] = ()

    def serves(self, model: str) -> bool:
        return not self.models or model in self.models

    def revision_of(self, model: str) -> str | None:
        return next((revision for name, revision in self.revisions if name == model), None)


def replica_entry(values: dict[str, Any]) -> ReplicaConfig:
    """One replica from a table (the file's ``[[replicas]]``, the admin API's body): its
    ``models`` are names, each ``NAME`` or ``NAME=REVISION``."""
    models = values.get("models", ())
    if isinstance(models, str) or not all(isinstance(m, str) and m.partition("=")[0] for m in models):
        raise ConfigError(f"replica {values.get('id')}: models must be a list of NAME or NAME=REVISION")
    pairs = [entry.partition("=") for entry in models]
    names, revisions = tuple(name for name, _, _ in pairs), tuple((name, rev) for name, _, rev in pairs if rev)
    return ReplicaConfig(**{**values, "models": names, "revisions": revisions})


@dataclass(frozen=True, slots=True)
class Routing:
    """``[routing]``: how attempts are placed (statemachine/routing.py), with
    ``[routing.models.NAME]`` overriding it for one model, fallbacks included."""

    default: RoutingConfig = DEFAULT_ROUTING
    models: dict[str, RoutingConfig] = field(default_factory=dict)

    def for_model(self, model: str) -> RoutingConfig:
        return self.models.get(model, self.default)

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> Routing:
        values = dict(values)
        models = values.pop("models", {})
        if not isinstance(models, dict) or not all(isinstance(v, dict) for v in models.values()):
            raise ConfigError("routing.models: a table per model")
        try:
            default = RoutingConfig.from_params(values)
            return cls(
                default,
                {name: RoutingConfig.from_params({**default.to_params(), **own}) for name, own in models.items()},
            )
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"routing: {exc}") from None

    def chains(self) -> dict[str, tuple[str, ...]]:
        """Every model named as a fallback, by the model whose settings name it."""
        return {
            model: (*config.fallbacks, *config.context_window_fallbacks, *config.content_policy_fallbacks)
            for model, config in {"": self.default, **self.models}.items()
        }


@dataclass(frozen=True, slots=True)
class Timeouts:
    lease_ttl_s: float = 5.0  # an attempt's lease; renewed every third of it while read
    stall_s: float = 2.0  # no frame at all for this long: liveness uncertain
    first_token_soft_s: float = 10.0  # queued this long: recorded, never migrated
    first_token_hard_s: float = 60.0  # queued this long: fenced and retried elsewhere
    # an OpenAI upstream (no heartbeats) with no first token this long (or first_token_hard_s,
    # the smaller): closed, and retried elsewhere while nothing was delivered (an answer asked
    # unstreamed, whose first frame comes with its last: first_token_hard_s)
    openai_first_token_s: float = 10.0
    connect_s: float = 2.0  # opening a connection to a replica
    cancel_ack_s: float = 2.0  # waiting for a worker's cancel acknowledgement
    upstream_response_s: float = 10.0  # an OpenAI upstream that sends no headers in time
