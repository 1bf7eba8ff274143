"""The replica pool: what the gateway knows of its replicas, and which are out.

How this works: each replica has a count of this gateway's outstanding attempts, the
other gateways' load on it (what it last reported holding, a worker's running +
queued attempts in its health answer, less this gateway's count then: a stale total
would hide how this gateway's own count changed since; raised between answers by the
queue positions its heartbeats give), a health flag from
background probes (a real 1-token generation), a circuit breaker, and a cool-down
from ``Retry-After``. The pool does not choose:
``snapshot`` gives the policy a pure view of it (:mod:`statemachine.routing`), the
policy places the attempt, and ``placed`` counts the choice (round robin's turn, and
ties going to the replica chosen least recently). After ``eject_after_failures``
failures in a row a replica is ejected for a back-off that doubles while it keeps
failing; the background probe lets it back in as soon as one probe succeeds.
A probe that got no answer in time does not count while output of the replica's live
attempts is read (heartbeats aside): it is alive, only slow to answer one more
generation. At saturation such probes timed out on a healthy, streaming replica and
ejected it, and every request was refused (``ops/bench/peers.py --saturation``; figures:
docs/performance.md). A silent replica is counted as before.
A replica that answers in a protocol this gateway does not speak is out at once, for as
long as it does (app/contract/worker_protocol.py).
The clock is injected so tests can move time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import httpx

from app.replicas.base import ProbeAnswer, UpstreamFailure
from app.replicas.candidates import bounded_candidates, takes
from app.replicas.replica import Replica
from statemachine.events import FailureKind
from statemachine.routing import PoolSnapshot, ReplicaView

log = logging.getLogger("phasegate.pool")

# Codes with which a worker ends an attempt by the protocol's rules, at the gateway's
# doing: a lease it did not renew in time, a newer epoch, its own cancel. The replica
# kept its word, so these do not count toward ejection: when an overloaded gateway
# renewed late, counting them ejected a healthy replica and refused every request
# (ops/bench/overhead.py with many held streams; figures: docs/performance.md).
GATEWAYS_DOING = frozenset({"lease_expired", "lease_revoked", "cancelled", "replica_drained"})
# An attempt on a cordoned replica still running at its drain deadline (docs/design.md §16):
# the operator's doing, never the replica's fault
REPLICA_DRAINED = "replica_drained"
_REPLICAS_FAULT = frozenset({FailureKind.REPLICA_EXITED, FailureKind.REJECTED, FailureKind.LIVENESS_UNCERTAIN})
# 4xx statuses on the replica's side of the call: its credentials (401, 403, 407: the
# gateway's worker_token is not the worker's), its own time-out (408) and its overload (429).
# Every other 4xx is about the request, whatever the failure is called: it never counts.
REPLICA_SIDE_4XX = frozenset({401, 403, 407, 408, 429})


class ReplicaPool:
    def __init__(
        self,
        replicas: Iterable[Replica],
        *,
        eject_after_failures: int = 3,
        ejection_s: float = 5.0,
        ejection_max_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.replicas = {replica.id: replica for replica in replicas}
        self.eject_after_failures = eject_after_failures
        self.first_ejection_s = ejection_s
        self.ejection_max_s = ejection_max_s
        self.clock = clock
        self.on_health_change: Callable[[Replica], None] = lambda replica: None
        self._choices = 0
        # by the models asked for and their revisions: each serving replica with the models it may take
        self._serving: dict[tuple[Any, ...], tuple[tuple[Replica, tuple[str, ...]], ...]] = {}
        self.retired: list[Replica] = []  # out of the fleet, with attempts still on them: closed once they end

    # --- membership (docs/design.md §16) ---------------------------------------------

    def admit(self, replica: Replica) -> None:
        """``replica`` is a member now (a new one, or a new incarnation replacing the old)."""
        old = self.replicas.get(replica.id)
        if old is not None and old is not replica:
            self._retire(old)
        self.replicas[replica.id] = replica
        self._serving.clear()

    def retire(self, replica_id: str) -> Replica | None:
        """``replica_id`` left the fleet: no new attempt; its live ones run to their end."""
        replica = self.replicas.pop(replica_id, None)
        if replica is not None:
            self._retire(replica)
            self._serving.clear()
        return replica

    def _retire(self, replica: Replica) -> None:
        replica.cordoned = True
        self.retired.append(replica)

    async def reap(self) -> None:
        """Close the clients of retired replicas whose attempts all ended."""
        done = [replica for replica in self.retired if replica.outstanding <= 0]
        self.retired = [replica for replica in self.retired if replica.outstanding > 0]
        await asyncio.gather(*(replica.client.close() for replica in done), return_exceptions=True)

    def unready(self) -> bool:
        """Members that could take work, and none available: unready. No member at all (an
        empty fleet, or every one cordoned) is ready: requests get ``no_replica_available``."""
        serving = [replica for replica in self.replicas.values() if not replica.cordoned]
        return bool(serving) and not any(self.available(replica) for replica in serving)

    def available(self, replica: Replica, model: str | None = None) -> bool:
        """Healthy, not ejected, not cooling down, and serving ``model`` if one is named."""
        return (
            (model is None or replica.config.serves(model))
            and not replica.cordoned
            and self._available_at(replica, self.clock())
        )

    @staticmethod
    def _available_at(replica: Replica, now: float) -> bool:
        return replica.healthy is not False and replica.ejected_until <= now and replica.cooldown_until <= now

    def snapshot(
        self,
        models: Iterable[str],
        *,
        revisions: Mapping[str, str | None] | None = None,
        keep: Iterable[str] = (),
        affinity_key: str | None = None,
    ) -> PoolSnapshot:
        """The replicas that may take an attempt of any of ``models``, as the policy places
        attempts over them: bounded however large the fleet (:func:`bounded_candidates`).

        A replica is a candidate for a model it serves at the revision ``revisions`` names
        (a replica that declares none for it is taken to be at it), when available and
        not cordoned; its view lists the models it may take (none: every one asked for).
        The replicas in ``keep`` (those the request tried) are shown whatever they are,
        so the policy sees a cordon or a lapse of the replica that just failed."""
        now = self.clock()
        wanted = tuple(models)
        asked = (wanted, tuple(sorted((revisions or {}).items())))
        serving = self._serving.get(asked)
        if serving is None:  # found again only when the fleet changes: which replica may take which model
            found = (
                (r, tuple(model for model in wanted if takes(r, model, revisions))) for r in self.replicas.values()
            )
            serving = tuple((r, eligible) for r, eligible in found if eligible or any(map(r.config.serves, wanted)))
            if len(self._serving) >= 256:  # model names no configuration knows: keep few
                self._serving.clear()
            self._serving[asked] = serving
        kept = set(keep)
        shown: dict[str, tuple[Replica, tuple[str, ...], bool]] = {}  # each replica shown: its models, available
        candidates: dict[str, list[Replica]] = {model: [] for model in wanted}
        for replica, eligible in serving:
            available = self._available_at(replica, now)
            if eligible and available and not replica.cordoned:
                for model in eligible:
                    candidates[model].append(replica)
                shown[replica.id] = (replica, eligible, available)
            elif replica.id in kept:
                shown[replica.id] = (replica, eligible, available)
        chosen = set(kept)
        for model_candidates in candidates.values():
            chosen.update(replica.id for replica in bounded_candidates(model_candidates, affinity_key))
        views = tuple(
            ReplicaView(
                id=replica.id,
                models=() if len(eligible) == len(wanted) else (eligible or ("",)),
                available=available,
                outstanding=replica.outstanding,
                others_load=replica.others_load,
                cooldown_s=round(max(replica.cooldown_until - now, 0.0), 3),
                last_chosen=replica.last_chosen,
                cordoned=replica.cordoned,
            )
            for replica, eligible, available in shown.values()
            if replica.id in chosen
        )
        return PoolSnapshot(views, self._choices)

    def placed(self, replica: Replica) -> None:
        """An attempt was placed on ``replica``: the next placement sees it chosen last."""
        self._choices += 1
        replica.last_chosen = self._choices

    def reported(self, replica: Replica, load: int) -> None:
        """What the replica says it holds (running + queued, every gateway's): less this
        gateway's own attempts, the other gateways' load on it."""
        replica.others_load = max(load - replica.outstanding, 0)

    def queued_at(self, replica: Replica, position: int) -> None:
        """A heartbeat says an attempt waits at ``position`` (1: next in line) for an engine
        slot: the replica holds at least that many waiting, between its health answers."""
        replica.others_load = max(replica.others_load, position - replica.outstanding)

    def any_available(self, model: str | None = None) -> bool:
        return any(self.available(replica, model) for replica in self.replicas.values())

    async def model_card(self, model: str, timeout_s: float = 2.0) -> dict[str, Any]:
        """What the first available replica serving ``model`` that answers in time says of
        it (``ReplicaClient.model_cards``); empty when none does."""
        for replica in [r for r in self.replicas.values() if self.available(r, model)]:
            try:
                async with asyncio.timeout(timeout_s):
                    card = (await replica.client.model_cards()).get(model)
            except TimeoutError:
                continue
            if card:
                return card
        return {}

    async def utility(self, path: str, body: dict[str, Any] | None, model: str | None) -> tuple[int, Any]:
        """vLLM's utility route ``path`` (``ReplicaClient.utility``) on the least loaded
        available replica serving ``model``: its status and JSON answer. Raises
        ``LookupError`` when none is available, ``ConnectionError`` when it gave no answer or
        refused the gateway itself (``REPLICA_SIDE_4XX``: its credentials, its load)."""
        available = [r for r in self.replicas.values() if self.available(r, model)]
        if not available:
            raise LookupError("no replica is available")
        replica = min(available, key=lambda r: r.outstanding)
        try:
            status, answer = await replica.client.utility(path, body)
        except (httpx.HTTPError, ValueError) as exc:
            raise ConnectionError(f"/{path} on replica {replica.id}: no answer ({exc!r})") from None
        if status in REPLICA_SIDE_4XX:
            raise ConnectionError(f"/{path} on replica {replica.id}: refused with {status}")
        return status, answer

    # --- what drivers and probes report --------------------------------------------

    def succeeded(self, replica: Replica) -> None:
        replica.consecutive_failures = 0
        replica.ejection_s = 0.0
        if replica.healthy is not True:
            replica.healthy = True
            self.on_health_change(replica)

    def failed(self, replica: Replica, detail: str) -> None:
        replica.consecutive_failures += 1
        if replica.consecutive_failures >= self.eject_after_failures:
            replica.ejection_s = min(max(replica.ejection_s * 2, self.first_ejection_s), self.ejection_max_s)
            replica.ejected_until = self.clock() + replica.ejection_s
            log.warning(
                "replica %s ejected for %.1fs after %d failures: %s",
                replica.id,
                replica.ejection_s,
                replica.consecutive_failures,
                detail,
            )
            if replica.healthy is not False:
                replica.healthy = False
                self.on_health_change(replica)

    def incompatible(self, replica: Replica, reason: str) -> None:
        """Out at once, and for as long as its probes find it so (app/contract/worker_protocol.py)."""
        if replica.incompatible != reason:
            log.error("replica %s is not used: %s", replica.id, reason)
        replica.incompatible = reason
        if replica.healthy is not False:
            replica.healthy = False
            self.on_health_change(replica)

    def observe(self, replica: Replica, failure: UpstreamFailure) -> None:
        """Account an attempt's failure to its replica: ``Retry-After`` cools it down,
        its own failures count toward ejection; a refused request, any other 4xx about the
        request (``REPLICA_SIDE_4XX`` aside) and the gateway's own doing (``GATEWAYS_DOING``)
        do not."""
        if failure.retry_after_s:
            self.cool_down(replica, failure.retry_after_s)
        if failure.kind is FailureKind.REQUEST_REFUSED:
            self.succeeded(replica)  # the replica is fine; the request was not
        elif _about_the_request(failure):
            pass  # a 4xx for this request: the client's fault, not the replica's (docs/design.md §13)
        elif failure.kind in _REPLICAS_FAULT and failure.code not in GATEWAYS_DOING:
            self.failed(replica, failure.detail)

    def cool_down(self, replica: Replica, seconds: float) -> None:
        """Honour ``Retry-After``: send this replica nothing new for ``seconds``."""
        replica.cooldown_until = max(replica.cooldown_until, self.clock() + seconds)

    # --- background probes -----------------------------------------------------------

    async def probe(self, replica: Replica) -> bool:
        frames_before = replica.frames_read
        try:
            answer = await replica.client.health()
        except Exception as exc:  # a probe must never take the loop down
            log.warning("health probe of %s raised %r", replica.id, exc)
            answer = ProbeAnswer.UNHEALTHY
        if replica.client.reported_load is not None:
            self.reported(replica, replica.client.reported_load)
        if answer is ProbeAnswer.INCOMPATIBLE:
            self.incompatible(replica, replica.client.incompatible or "incompatible")
            return False
        replica.incompatible = None
        if answer is ProbeAnswer.HEALTHY:
            replica.ejected_until = 0.0
            self.succeeded(replica)
            return True
        frames = replica.frames_read - frames_before
        if answer is ProbeAnswer.SILENT and frames:  # alive: busy, not silent
            log.info("health probe of %s unanswered, not counted: %d frames read from it meanwhile", replica.id, frames)
        else:  # one failure among others: a busy replica may miss one probe
            self.failed(replica, f"health probe failed: {answer.value}")
        return False

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(replica) for replica in self.replicas.values()))

    async def run_probes(self, interval_s: float) -> None:
        """Probe every replica every ``interval_s`` until cancelled."""
        while True:
            await self.probe_all()
            await asyncio.sleep(interval_s)

    async def close(self) -> None:
        replicas = [*self.replicas.values(), *self.retired]
        await asyncio.gather(*(replica.client.close() for replica in replicas))


def _about_the_request(failure: UpstreamFailure) -> bool:
    status = failure.status
    return status is not None and 400 <= status < 500 and status not in REPLICA_SIDE_4XX
