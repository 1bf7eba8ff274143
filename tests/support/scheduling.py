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
lets a plugin do.) The units go out largest first, by test count, as in xdist's
``loadscope``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling

GROUPS_ENV = "PHASEGATE_TEST_GROUPS"


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
    path = Path(folder) / f"{worker}.json"
    path.with_suffix(".tmp").write_text(json.dumps(found))
    path.with_suffix(".tmp").replace(path)


class ModuleOrGroupScheduling(LoadScopeScheduling):
    """A test's group if it has one, else its module."""

    _groups: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._groups is None:
            self._groups = {}
            for path in Path(os.environ[GROUPS_ENV]).glob("*.json"):  # every process collected the same
                self._groups = json.loads(path.read_text())
                break
        return self._groups.get(nodeid) or nodeid.split("::", 1)[0]
