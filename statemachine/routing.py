"""Where an attempt goes: pure placement over a snapshot of the pool.

The driver takes a :class:`PoolSnapshot` (each replica's health, this gateway's
in-flight count, the load the replica itself reported, its cool-down) when the
policy may start an attempt; the policy places the attempt with :func:`place` and
records the snapshot on the ``Decided`` event, so replay places it again from the
same input and names any divergence.

The strategies (:class:`Strategy`), each over the replicas that serve the model,
are available and not excluded:

- ``least_outstanding``: the least loaded; ties go to the one chosen least recently.
  (Also what ``prefix_affinity`` does for a request with no key.)
  A replica's load is this gateway's attempts on it (counted now) plus the other
  gateways' (what it last reported holding, a worker's running + queued, less this
  gateway's attempts then).
- ``prefix_affinity``: the conversation's key (a hash of its leading messages, or the
  client's ``user``) ranks the replicas by rendezvous hashing; the first whose load
  stays within ``affinity_load_factor`` of the mean, plus one (consistent hashing with
  bounded load; the one keeps a lightly loaded pool from moving a conversation off
  its replica for a single request) takes it, so turns of one conversation reuse a replica's prefix cache without
  piling onto it. No key: least outstanding. The default: it measured best
  (``ops/bench/routing.py``).
- ``round_robin``: the next in id order after the gateway's count of placements.
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any


class Strategy(enum.StrEnum):
    LEAST_OUTSTANDING = "least_outstanding"
    PREFIX_AFFINITY = "prefix_affinity"
    ROUND_ROBIN = "round_robin"


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """One replica as the pool saw it when the decision was taken."""

    id: str
    models: tuple[str, ...] = ()  # empty: every model
    available: bool = True  # healthy, not ejected, not cooling down
    outstanding: int = 0  # this gateway's attempts on it
    others_load: int = 0  # other gateways' attempts on it, as of its last report
    cooldown_s: float = 0.0  # what is left of a Retry-After cool-down
    last_chosen: int = 0  # the gateway's placement count when it was last chosen
    cordoned: bool = False  # the operator's: no new attempt (docs/design.md §16)

    def serves(self, model: str) -> bool:
        return not self.models or model in self.models

    @property
    def takes_new(self) -> bool:
        """Whether a new attempt may go to it: available and not cordoned."""
        return self.available and not self.cordoned

    @property
    def load(self) -> int:
        return self.outstanding + self.others_load


_VIEW_DEFAULTS = tuple((f.name, f.default) for f in fields(ReplicaView) if f.name != "id")


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    replicas: tuple[ReplicaView, ...] = ()
    placements: int = 0  # placements this gateway made before: round robin's turn

    def view(self, replica_id: str) -> ReplicaView | None:
        return next((view for view in self.replicas if view.id == replica_id), None)

    def to_params(self) -> dict[str, Any]:
        """As JSON values, for the ``Decided`` event (defaults left out: it is on every start)."""
        replicas = []
        for view in self.replicas:
            entry: dict[str, Any] = {"id": view.id}
            for name, default in _VIEW_DEFAULTS:  # field by field: asdict() copies deeply, per start
                value = getattr(view, name)
                if value != default:
                    entry[name] = list(value) if isinstance(value, tuple) else value
            replicas.append(entry)
        return {"placements": self.placements, "replicas": replicas}

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> PoolSnapshot:
        names = {f.name for f in fields(ReplicaView)}
        views = []
        for entry in params.get("replicas", ()):
            values = {name: value for name, value in entry.items() if name in names}
            values["models"] = tuple(values.get("models", ()))
            views.append(ReplicaView(**values))
        return cls(tuple(views), int(params.get("placements", 0)))


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """How one request is placed, recorded on its ``RequestAccepted`` so replay uses it."""

    strategy: Strategy = Strategy.PREFIX_AFFINITY  # what measured best (docs/routing.md)
    affinity_load_factor: float = 1.25  # prefix affinity: a replica over this times the mean load is passed over
    retry_same_max_wait_s: float = 2.0  # a Retry-After up to this may be waited out on the same replica
    fallbacks: tuple[str, ...] = ()  # models tried in order after any failure before output
    context_window_fallbacks: tuple[str, ...] = ()  # after a context_length_exceeded refusal
    content_policy_fallbacks: tuple[str, ...] = ()  # after a content-policy refusal

    def __post_init__(self) -> None:
        if not isinstance(self.strategy, Strategy):
            if self.strategy not in tuple(Strategy):
                raise ValueError(f"strategy must be one of {', '.join(Strategy)}")
            object.__setattr__(self, "strategy", Strategy(self.strategy))
        if not self.affinity_load_factor >= 1:
            raise ValueError("affinity_load_factor must be at least 1")
        if not 0 <= self.retry_same_max_wait_s <= 60:
            raise ValueError("retry_same_max_wait_s must be between 0 and 60 seconds")

    def to_params(self, *, compact: bool = False) -> dict[str, Any]:
        """As JSON values; ``compact``: the strategy and the fields off their defaults only
        (what each ``RequestAccepted`` records: computed once a configuration)."""
        if compact:
            known = _COMPACT_PARAMS.get(self)
            if known is None:
                known = _COMPACT_PARAMS[self] = self._params(compact=True)
            return dict(known)  # its lists are never changed: an event holds them as they are
        return self._params(compact=False)

    def _params(self, *, compact: bool) -> dict[str, Any]:
        return {
            name: list(value) if isinstance(value, tuple) else (value.value if isinstance(value, enum.Enum) else value)
            for name, value, default in ((f.name, getattr(self, f.name), f.default) for f in fields(self))
            if not compact or name == "strategy" or value != default
        }

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> RoutingConfig:
        """From ``to_params``' values (each request's ``RequestAccepted``: the few
        configurations seen are built once each)."""
        key = tuple(
            (name, type(value), tuple(value) if isinstance(value, list) else value) for name, value in params.items()
        )
        try:
            built = _FROM_PARAMS.get(key)
        except TypeError:  # a value that is not hashable: invalid, as building it says
            return cls._from_params(params)
        if built is None:
            built = cls._from_params(params)
            if len(_FROM_PARAMS) >= _KEPT_CONFIGS:
                _FROM_PARAMS.clear()
            _FROM_PARAMS[key] = built
        return built

    @classmethod
    def _from_params(cls, params: Mapping[str, Any]) -> RoutingConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"unknown routing settings: {', '.join(unknown)}")
        values = dict(params)
        for name in ("fallbacks", "context_window_fallbacks", "content_policy_fallbacks"):
            if name in values:
                chain = values[name]
                if isinstance(chain, str) or not all(isinstance(model, str) and model for model in chain):
                    raise ValueError(f"{name} must be a list of model names")
                values[name] = tuple(chain)
        return cls(**values)


DEFAULT_ROUTING = RoutingConfig()
_KEPT_CONFIGS = 64
_COMPACT_PARAMS: dict[RoutingConfig, dict[str, Any]] = {}
_FROM_PARAMS: dict[tuple[tuple[str, type, Any], ...], RoutingConfig] = {}


@dataclass(frozen=True, slots=True)
class Placement:
    replica: str | None  # None: no replica can take it
    why: str  # the strategy that chose, or why none could


def place(
    pool: PoolSnapshot,
    model: str,
    exclude: Iterable[str],
    config: RoutingConfig,
    affinity_key: str | None = None,
) -> Placement:
    """The replica for an attempt of ``model``, by ``config.strategy``."""
    excluded = set(exclude)
    candidates = [view for view in pool.replicas if view.serves(model) and view.takes_new and view.id not in excluded]
    if not candidates:
        return Placement(None, f"no available replica serves {model}")
    if config.strategy is Strategy.ROUND_ROBIN:
        ordered = sorted(candidates, key=lambda view: view.id)
        return Placement(ordered[pool.placements % len(ordered)].id, Strategy.ROUND_ROBIN.value)
    if config.strategy is Strategy.PREFIX_AFFINITY and affinity_key is not None:
        return _by_affinity(candidates, affinity_key, config.affinity_load_factor)
    return Placement(least_loaded(candidates).id, Strategy.LEAST_OUTSTANDING.value)


def least_loaded(candidates: Iterable[ReplicaView]) -> ReplicaView:
    return min(candidates, key=lambda view: (view.load, view.last_chosen, view.id))


def _by_affinity(candidates: list[ReplicaView], key: str, factor: float) -> Placement:
    # bounded load (Mirrokni et al.): a replica may hold at most ceil(factor * mean) + 1,
    # the new attempt counted, so the least loaded always fits
    total = sum(view.load for view in candidates) + 1
    bound = math.ceil(factor * total / len(candidates)) + AFFINITY_SLACK
    ranked = sorted(candidates, key=lambda view: rank(key, view.id), reverse=True)
    for position, view in enumerate(ranked):
        if view.load + 1 <= bound:
            why = Strategy.PREFIX_AFFINITY.value
            return Placement(view.id, why if position == 0 else f"{why}: preferred replica over its load bound")
    raise AssertionError("the least loaded replica is within the bound")  # pragma: no cover


AFFINITY_SLACK = 1


def rank(key: str, replica_id: str) -> int:
    """Rendezvous hashing's weight of ``replica_id`` for ``key``: stable across processes."""
    digest = hashlib.blake2b(f"{key}\x00{replica_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")
