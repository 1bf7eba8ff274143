"""What the gateway knows of one replica (app/replicas/pool.py keeps them): its
configuration and client, this gateway's outstanding attempts and the other gateways'
load on it, its health, failures, ejection and cool-down, its fleet incarnation and
cordon, and the renewer of its attempts' leases."""

from __future__ import annotations

from dataclasses import dataclass, field

from app.config import ReplicaConfig
from app.replicas.base import ReplicaClient
from app.replicas.renewer import LeaseRenewer


@dataclass(slots=True)
class Replica:
    config: ReplicaConfig
    client: ReplicaClient
    outstanding: int = 0
    healthy: bool | None = None  # None until the first probe answers
    consecutive_failures: int = 0
    ejected_until: float = 0.0
    ejection_s: float = 0.0
    cooldown_until: float = 0.0  # from an upstream Retry-After
    last_chosen: int = 0  # when it was last chosen: ties go to the one idle longest
    frames_read: int = 0  # output frames (not heartbeats) of its live attempts: signs of life between probes
    others_load: int = 0  # other gateways' attempts on it, as of its last report
    incompatible: str | None = None  # why its probes find it unusable whatever its health (None: they do not)
    incarnation: str = ""  # the fleet's incarnation of it (docs/design.md §16)
    cordoned: bool = False  # no new attempt; live ones run on (to drain_deadline, if any)
    drain_deadline: float | None = None  # on the pool's clock: its live attempts are fenced after it
    renewer: LeaseRenewer = field(init=False)  # renews the leases of its attempts, all at once

    def __post_init__(self) -> None:
        self.renewer = LeaseRenewer(self.client)

    @property
    def id(self) -> str:
        return self.config.id
