"""statemachine/ imports only downward, as app/ does (tests/app/test_layering.py): each module
may import the modules ``BELOW`` lists for it, and no two import each other.

    replay, invariants, trace → policy → placing → actions → request_state → events
                                state → handlers → attempts, batches, evolve, phases → events → deltas

Leaves (``deltas``, ``errors``, ``evolve``, ``routing``, ``policy_config``) import nothing of
the package. A new module or a new arrow is a line here, where a circle would show.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.imports import arrows, cycles, module_name, modules, reaches_itself

ROOT = Path(__file__).resolve().parents[2]


def _of(*names: str) -> frozenset[str]:
    return frozenset(f"statemachine.{name}" for name in names)


BELOW: dict[str, frozenset[str]] = {
    "statemachine": _of(),
    # leaves: a delta's words, the errors, the evolve helper, placement's data, the policy's knobs
    "statemachine.deltas": _of(),
    "statemachine.errors": _of(),
    "statemachine.evolve": _of(),
    "statemachine.routing": _of(),
    "statemachine.policy_config": _of(),
    # the vocabulary, the phase table, its diagram, the JSON form of events, delivery batches
    "statemachine.reasons": _of(),
    "statemachine.envelopes": _of(),
    "statemachine.events": _of("deltas", "envelopes", "reasons"),
    "statemachine.phases": _of("errors", "events"),
    "statemachine.diagram": _of("phases"),
    "statemachine.field_parsers": _of("deltas"),
    "statemachine.jsonform": _of("deltas", "errors", "events", "field_parsers"),
    "statemachine.batches": _of("deltas", "events"),
    # the fold: a request's state, its handlers, apply
    "statemachine.request_state": _of("events", "phases", "routing"),
    "statemachine.attempts": _of("envelopes", "errors", "evolve", "request_state"),
    "statemachine.handlers": _of("attempts", "batches", "events", "evolve", "phases", "request_state", "routing"),
    "statemachine.state": _of("attempts", "events", "evolve", "handlers", "phases", "request_state"),
    # the policy: its actions, where an attempt goes, decide
    "statemachine.actions": _of("request_state", "routing"),
    "statemachine.placing": _of("actions", "events", "policy_config", "request_state", "routing"),
    "statemachine.policy": _of("actions", "events", "phases", "placing", "policy_config", "request_state", "routing"),
    # what runs the policy over a log: replay, the invariants, traces
    "statemachine.replay": _of("actions", "events", "policy", "policy_config", "request_state", "routing", "state"),
    "statemachine.invariants": _of("errors", "events", "policy", "policy_config", "replay", "request_state"),
    "statemachine.trace": _of("actions", "errors", "events", "jsonform", "request_state", "state"),
}
MODULES = modules(ROOT, "statemachine")


@pytest.mark.parametrize("path", MODULES.values(), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_imports_only_what_is_below_it(path: Path) -> None:
    source = module_name(path, ROOT)
    allowed = BELOW[source]
    found = [str(arrow) for arrow in arrows(path, ROOT, set(MODULES)) if arrow.target not in allowed]
    assert not found, f"imports {source} may not make (statemachine/ imports downward):\n" + "\n".join(found)


def test_every_module_is_in_the_table_and_the_table_runs_downward() -> None:
    assert set(BELOW) == set(MODULES)
    assert reaches_itself(BELOW) == []


def test_no_import_cycles() -> None:
    found = cycles(ROOT, "statemachine")
    assert not found, "import cycles:\n" + "\n".join(" ; ".join(map(str, cycle)) for cycle in found)
