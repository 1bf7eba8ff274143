"""phasegate's configuration: defaults, a TOML file, environment and flags.

Precedence, lowest first: the defaults below, the file given with ``--config``,
environment variables (``DATABASE_URL``, ``PHASEGATE_DATA_DIR``), command-line flags.
Every setting is validated at load time; a bad one stops the start with a message
naming it.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.config_tables import ConfigError as ConfigError
from app.config_tables import Limits as Limits
from app.config_tables import ReplicaConfig as ReplicaConfig
from app.config_tables import Routing as Routing
from app.config_tables import TenantLimit as TenantLimit
from app.config_tables import TenantLimits as TenantLimits
from app.config_tables import Timeouts as Timeouts
from app.config_tables import replica_entry as replica_entry
from app.contract.worker_token import TOKEN_ENV, TokenError, check_token, read_token_file
from app.discover_config import DiscoverConfig, DiscoverError, parse_discover
from app.http.server import HttpLimits
from statemachine.policy_config import PolicyConfig

REPLICA_KINDS = ("worker", "openai")
CONTENT_POLICIES = ("full", "digest", "none")
SHA256_PREFIX = "sha256:"  # an api_keys entry that is a key's digest, not the key
LOG_FORMATS = ("text", "json")
_HTTP_DEFAULTS = HttpLimits()


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    database_url: str | None = None  # None: the embedded PostgreSQL
    data_dir: Path | None = None  # the embedded PostgreSQL's home (None: its default)
    database_wait_s: float = 60.0  # how long a start waits for database_url to answer (app/store/reach.py)
    replicas: tuple[ReplicaConfig, ...] = ()
    discover: tuple[DiscoverConfig, ...] = ()  # [[discover]]: DNS names whose records are replicas
    models: dict[str, str] = field(default_factory=dict)  # served model name -> revision
    # key (or "sha256:<hex of the key>") -> tenant; with none here and none in the api_keys
    # table (phasegate keys): open, tenant "default". Never printed.
    api_keys: dict[str, str] = field(default_factory=dict, repr=False)
    api_key_cache_s: float = 10.0  # how long a key looked up in PostgreSQL is trusted (a revocation's delay)
    admin_token: str | None = field(default=None, repr=False)
    admin_token_file: Path | None = None  # read at load when admin_token is not set (a mounted secret)
    # the worker protocol's shared secret, sent to every worker replica (never printed)
    worker_token: str | None = field(default=None, repr=False)
    worker_token_file: Path | None = None  # read at load when worker_token is not set
    metrics_token: str | None = field(default=None, repr=False)  # set: /metrics needs it (Bearer)
    cors_allow_origins: tuple[str, ...] = ()  # empty: no CORS headers, so no page elsewhere reads answers
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    routing: Routing = field(default_factory=Routing)
    timeouts: Timeouts = field(default_factory=Timeouts)
    limits: Limits = field(default_factory=Limits)
    tenant_limits: TenantLimits = field(default_factory=TenantLimits)  # off unless configured
    content_policy: str = "full"  # how delivered text is kept in the log: full, digest or none
    max_body_bytes: int = 1 << 20
    # how long a client may take over a request's headers (trickled or not), over its body,
    # and how long a kept-alive connection may idle (app/http/server.py); headers over
    # http_max_header_bytes get 431
    http_header_timeout_s: float = _HTTP_DEFAULTS.header_timeout_s
    http_body_timeout_s: float = _HTTP_DEFAULTS.body_timeout_s
    http_keep_alive_s: float = _HTTP_DEFAULTS.keep_alive_s
    http_max_header_bytes: int = _HTTP_DEFAULTS.max_header_bytes
    retry_budget_burst: int = 20  # global retries available at once
    retry_budget_per_s: float = 5.0  # and refilled at this rate
    delivery_batch_tokens: int = 16  # deltas recorded per DeltasDelivered event at most
    delivery_batch_ms: float = 20.0  # and no older than this
    health_interval_s: float = 5.0
    eject_after_failures: int = 3
    ejection_s: float = 5.0  # first ejection; doubles to ejection_max_s while failures go on
    ejection_max_s: float = 60.0
    tool_webhook_url: str | None = None  # where tool calls are executed, once per idempotency key
    apply_migrations: bool = True
    instance_name: str | None = None  # how this gateway instance is listed (default host:port)
    instance_lease_ttl_s: float = 10.0  # an instance's lease, renewed every third of it
    sweep_interval_s: float = 2.0  # how often a live instance looks for lapsed ones
    drain_s: float = 30.0  # SIGTERM: how long open streams may run before their final error
    idempotency_ttl_s: float = 86400.0  # how long an Idempotency-Key binds its request
    # The log's day partitions (docs/scaling.md): made this many days ahead; dropped past
    # retention_days (None: kept for ever), archived to archive_dir first when it is set;
    # each gateway runs the maintenance every maintain_interval_s (0: only by hand)
    partitions_ahead_days: int = 3
    retention_days: int | None = None
    archive_dir: Path | None = None
    maintain_interval_s: float = 3600.0
    resume_grace_s: float = 10.0  # a client that left may attach again this long; 0: cancel at once
    log_format: str = "text"  # "json": one object a line, with request_id, attempt and instance
    otel_endpoint: str | None = None  # OTLP/HTTP traces endpoint; unset: no tracing (the otel extra)
    otel_service_name: str = "phasegate"

    def __post_init__(self) -> None:
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(f"log_format must be one of {', '.join(LOG_FORMATS)}")
        if self.content_policy not in CONTENT_POLICIES:
            raise ConfigError(f"content_policy must be one of {', '.join(CONTENT_POLICIES)}")
        ids = [replica.id for replica in self.replicas]
        if len(set(ids)) != len(ids):
            raise ConfigError("replica ids must be unique")
        for replica in self.replicas:
            if replica.kind not in REPLICA_KINDS:
                raise ConfigError(f"replica {replica.id}: kind must be one of {', '.join(REPLICA_KINDS)}")
            if not replica.url.startswith(("http://", "https://")):
                raise ConfigError(f"replica {replica.id}: url must be http(s)://…")
        for entry in self.discover:
            unknown = [name for name in entry.model_names if self.models and name not in self.models]
            if unknown:
                raise ConfigError(f"discover ({entry.name}): model {unknown[0]!r} is not in models")
        for origin in self.cors_allow_origins:
            if origin != "*" and not re.fullmatch(r"https?://[^/\s]+", origin):
                raise ConfigError(f"cors_allow_origins: {origin!r} is not '*' or scheme://host[:port]")
        if self.metrics_token is not None and len(self.metrics_token) < 16:
            raise ConfigError("metrics_token must have at least 16 characters")
        for key, tenant in self.api_keys.items():
            if not isinstance(key, str) or not isinstance(tenant, str) or not key or not tenant:
                raise ConfigError("api_keys: each entry is a key (or sha256:<hex>) = tenant, both text")
        # a "sha256:" entry that is not 64 hex digits (a placeholder never replaced) can
        # match no key: the gateway warns at start, naming the tenant (app/api/auth.py)
        if self.api_key_cache_s < 0 or self.database_wait_s < 0:
            raise ConfigError("api_key_cache_s and database_wait_s must not be negative")
        if self.max_body_bytes < 1024:
            raise ConfigError("max_body_bytes must be at least 1024")
        for problem in self.http_limits.problems():
            raise ConfigError(f"http_{problem}")
        if self.timeouts.lease_ttl_s <= 0 or self.timeouts.stall_s <= 0:
            raise ConfigError("timeouts must be positive")
        if self.instance_lease_ttl_s <= 0 or self.sweep_interval_s <= 0 or self.drain_s < 0:
            raise ConfigError("instance_lease_ttl_s and sweep_interval_s must be positive, drain_s not negative")
        if self.retention_days is not None and (isinstance(self.retention_days, bool) or self.retention_days < 1):
            raise ConfigError("retention_days must be a whole number of days, at least 1 (unset: keep everything)")
        if not 1 <= self.partitions_ahead_days <= 366:
            raise ConfigError("partitions_ahead_days must be between 1 and 366")
        if self.maintain_interval_s < 0:
            raise ConfigError("maintain_interval_s must not be negative (0: no maintenance by the gateway)")
        if not 0 <= self.resume_grace_s <= 3600:
            raise ConfigError("resume_grace_s must be between 0 and 3600 seconds")
        for model, chain in self.routing.chains().items():
            if self.models and model and model not in self.models:
                raise ConfigError(f"routing.models.{model}: no such model in models")
            unknown = [name for name in chain if self.models and name not in self.models]
            if unknown:
                raise ConfigError(f"routing: fallback model {unknown[0]!r} is not in models")
        if self.timeouts.first_token_soft_s > self.timeouts.first_token_hard_s:
            raise ConfigError("first_token_soft_s must not exceed first_token_hard_s")
        if not self.timeouts.openai_first_token_s > 0:  # not: NaN is refused too
            raise ConfigError("openai_first_token_s must be positive")

    @property
    def http_limits(self) -> HttpLimits:
        return HttpLimits(
            header_timeout_s=self.http_header_timeout_s,
            body_timeout_s=self.http_body_timeout_s,
            keep_alive_s=self.http_keep_alive_s,
            max_header_bytes=self.http_max_header_bytes,
        )

    def model_revision(self, model: str) -> str | None:
        return self.models.get(model)


def parse_replica(text: str, index: int) -> ReplicaConfig:
    """``[KIND=]URL[#ID]`` from a flag, e.g. ``openai=http://127.0.0.1:8100#vllm``."""
    kind, _, rest = text.partition("=") if "=" in text.split("://")[0] else ("worker", "", text)
    url, _, replica_id = rest.partition("#")
    return ReplicaConfig(id=replica_id or f"r{index}", url=url.rstrip("/"), kind=kind)


def load_config(path: Path | None = None, **overrides: Any) -> GatewayConfig:
    """Defaults, then ``path`` (TOML), then the environment, then ``overrides``."""
    values: dict[str, Any] = {}
    if path is not None:
        try:
            values = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read {path}: {exc}") from None
    if os.environ.get("DATABASE_URL"):
        values["database_url"] = os.environ["DATABASE_URL"]
    if os.environ.get("PHASEGATE_DATA_DIR"):
        values["data_dir"] = os.environ["PHASEGATE_DATA_DIR"]
    if os.environ.get(TOKEN_ENV):
        values["worker_token"] = os.environ[TOKEN_ENV]
    values.update({key: value for key, value in overrides.items() if value is not None})
    return _build(values)


def _read_admin_token(values: dict[str, Any]) -> None:
    """``admin_token`` from ``admin_token_file`` when not given (surrounding whitespace dropped)."""
    if values.get("admin_token_file") is None:
        return
    path = values["admin_token_file"] = Path(values["admin_token_file"])
    if values.get("admin_token") is None:
        try:
            values["admin_token"] = path.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read admin_token_file {path}: {exc}") from None
        if not values["admin_token"]:
            raise ConfigError(f"admin_token_file {path} is empty")


def _resolve_worker_token(values: dict[str, Any]) -> None:
    """``worker_token`` checked, or read from ``worker_token_file`` when not given."""
    try:
        if values.get("worker_token_file") is not None:
            values["worker_token_file"] = Path(values["worker_token_file"])
            if values.get("worker_token") is None:
                values["worker_token"] = read_token_file(values["worker_token_file"])
        if values.get("worker_token") is not None:
            if not isinstance(values["worker_token"], str):
                raise ConfigError("worker_token must be a string")
            check_token(values["worker_token"], "worker_token")
    except TokenError as exc:
        raise ConfigError(str(exc)) from None


def _build(values: dict[str, Any]) -> GatewayConfig:
    known = {f.name for f in dataclasses.fields(GatewayConfig)}
    if unknown := sorted(set(values) - known):
        raise ConfigError(f"unknown settings: {', '.join(unknown)}")
    try:
        if "replicas" in values:
            values["replicas"] = tuple(
                r if isinstance(r, ReplicaConfig) else replica_entry(r) for r in values["replicas"]
            )
        if "discover" in values:
            values["discover"] = parse_discover(values["discover"])
        if isinstance(values.get("policy"), dict):
            values["policy"] = PolicyConfig.from_mapping(values["policy"])
        if isinstance(values.get("routing"), dict):
            values["routing"] = Routing.from_mapping(values["routing"])
        if isinstance(values.get("timeouts"), dict):
            values["timeouts"] = Timeouts(**values["timeouts"])
        if isinstance(values.get("tenant_limits"), dict):
            values["tenant_limits"] = TenantLimits.from_mapping(values["tenant_limits"])
        if isinstance(values.get("limits"), dict):
            values["limits"] = Limits(**values["limits"])
        if "cors_allow_origins" in values:
            origins = values["cors_allow_origins"]
            if isinstance(origins, str) or not all(isinstance(o, str) for o in origins):
                raise ConfigError("cors_allow_origins must be a list of origins")
            values["cors_allow_origins"] = tuple(origins)
        for name in ("data_dir", "archive_dir"):
            if values.get(name) is not None:
                values[name] = Path(values[name])
        _resolve_worker_token(values)
        _read_admin_token(values)
        return GatewayConfig(**values)
    except TypeError as exc:
        raise ConfigError(f"bad setting: {exc}") from None
    except DiscoverError as exc:
        raise ConfigError(str(exc)) from None
