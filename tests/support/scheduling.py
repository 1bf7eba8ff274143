"""How the suite is shared among pytest-xdist's processes: a module at a time, and every
test of a named group together.

A module is one unit of work because its module-scoped fixtures (a pair of sim workers,
a gateway on a package database) are costly to start twice, and because some modules
end with a test that reads what the ones before it left (a server's log). A group gathers
tests of several modules around one costly shared thing: ``vllm`` (every test marked
``vllm``, tests/conftest.py) shares one ``vllm serve`` and one vLLM worker per run.

The scheduler runs in the controlling process and sees only node ids, so each xdist
process writes the groups of the tests it collected into a folder the controller made
(``$PHASEGATE_TEST_GROUPS``), and the scheduler reads them once every process has
collected. (xdist's own ``--dist loadgroup`` renames node ids, which pytest 9 no longer
lets a plugin do.) A test marked ``own_unit`` is a unit by itself (a long test of a module
whose other tests need not wait behind it).

The units go out longest first, by the seconds each module's tests took in a full run
(:data:`SECONDS`, ``tests/support/unit_seconds.json``, written by
``python -m tests.support.unit_seconds JUNIT_XML``), so that the run ends on short units
rather than on a long one started last; a module the table does not know counts a second
a test. A stale table only makes the run slower, never different.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling
from xdist.workermanage import WorkerController

GROUPS_ENV = "PHASEGATE_TEST_GROUPS"
SECONDS = Path(__file__).with_name("unit_seconds.json")
OWN_UNIT = "own_unit"  # the marker of a test that is a unit by itself


def make_groups_folder() -> None:
    """In the controlling process, before the xdist processes start: the folder they write to."""
    os.environ[GROUPS_ENV] = tempfile.mkdtemp(prefix="phasegate-test-groups-")


def remove_groups_folder() -> None:
    folder = os.environ.pop(GROUPS_ENV, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def record_groups(items: list[pytest.Item], groups: dict[str, str]) -> None:
    """In an xdist process: the group of each collected test that has one (``groups`` maps
    a marker's name to its group)."""
    folder, worker = os.environ.get(GROUPS_ENV), os.environ.get("PYTEST_XDIST_WORKER")
    if folder is None or worker is None:
        return
    found = {
        item.nodeid: group
        for item in items
        for marker, group in groups.items()
        if item.get_closest_marker(marker) is not None
    }
    found |= {item.nodeid: item.nodeid for item in items if item.get_closest_marker(OWN_UNIT) is not None}
    path = Path(folder) / f"{worker}.json"
    path.with_suffix(".tmp").write_text(json.dumps(found))
    path.with_suffix(".tmp").replace(path)


def expected_seconds(nodeids: list[str], table: dict[str, dict[str, float]]) -> float:
    """What the tests ``nodeids`` are expected to take: each its module's seconds a test."""
    total = 0.0
    for nodeid in nodeids:
        module = table.get(nodeid.split("::", 1)[0])
        total += module["seconds"] / module["tests"] if module else 1.0
    return total


class ModuleOrGroupScheduling(LoadScopeScheduling):
    """A test's group if it has one, else its module; the longest units first."""

    _groups: dict[str, str] | None = None
    _ordered = False

    def _assign_work_unit(self, node: WorkerController) -> None:
        if not self._ordered:  # the first assignment: the queue is whole
            self._ordered = True
            table = json.loads(SECONDS.read_text()) if SECONDS.exists() else {}
            cost = {scope: expected_seconds(list(nodeids), table) for scope, nodeids in self.workqueue.items()}
            for scope in sorted(cost, key=lambda scope: -cost[scope]):
                self.workqueue.move_to_end(scope)
        super()._assign_work_unit(node)

    def _split_scope(self, nodeid: str) -> str:
        if self._groups is None:
            self._groups = {}
            for path in Path(os.environ[GROUPS_ENV]).glob("*.json"):  # every process collected the same
                self._groups = json.loads(path.read_text())
                break
        return self._groups.get(nodeid) or nodeid.split("::", 1)[0]
