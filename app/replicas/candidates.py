"""Which replicas a pool's snapshot shows the policy for one model (app/replicas/pool.py):
those that may take it at the revision wanted, bounded however large the fleet."""

from __future__ import annotations

import heapq
from collections.abc import Mapping

from app.replicas.replica import Replica
from statemachine.routing import rank

# Candidates a snapshot shows of one model at most: the least loaded and those the request's
# affinity key ranks first. A ``Decided`` event records the snapshot, so it must stay small
# at any fleet size (docs/routing.md); least_outstanding's choice is the same as over all.
LEAST_LOADED_SHOWN = 12
PREFERRED_SHOWN = 4


def bounded_candidates(candidates: list[Replica], affinity_key: str | None) -> list[Replica]:
    """The candidates a snapshot keeps of one model: all of them up to
    ``LEAST_LOADED_SHOWN + PREFERRED_SHOWN``, else the least loaded and the preferred."""
    if len(candidates) <= LEAST_LOADED_SHOWN + PREFERRED_SHOWN:
        return candidates
    by_load = heapq.nsmallest(
        LEAST_LOADED_SHOWN, candidates, key=lambda r: (r.outstanding + r.others_load, r.last_chosen, r.id)
    )
    if affinity_key is None:
        return by_load
    return by_load + heapq.nlargest(PREFERRED_SHOWN, candidates, key=lambda r: rank(affinity_key, r.id))


def takes(replica: Replica, model: str, revisions: Mapping[str, str | None] | None) -> bool:
    """Whether ``replica`` may take ``model`` at the revision wanted (docs/design.md §16)."""
    if not replica.config.serves(model):
        return False
    wanted = (revisions or {}).get(model)
    declared = replica.config.revision_of(model)
    return wanted is None or declared is None or declared == wanted
