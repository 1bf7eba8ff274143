"""The suite's schedule (tests/support/scheduling.py): the units' expected seconds, from
the committed table of a full run's modules."""

from __future__ import annotations

import json

from tests.support.scheduling import SECONDS, expected_seconds
from tests.support.unit_seconds import module_of

TABLE = {"tests/a/test_long.py": {"tests": 4, "seconds": 400.0}}


def test_a_known_modules_tests_take_its_seconds_a_test_and_an_unknown_one_a_second() -> None:
    assert expected_seconds(["tests/a/test_long.py::test_x", "tests/a/test_long.py::test_y[1]"], TABLE) == 200.0
    assert expected_seconds(["tests/b/test_new.py::test_z"], TABLE) == 1.0
    assert expected_seconds([], TABLE) == 0.0


def test_the_committed_table_names_the_suites_own_modules() -> None:
    table = json.loads(SECONDS.read_text())
    assert len(table) > 100 and all(entry["tests"] > 0 and entry["seconds"] >= 0 for entry in table.values())
    a_class = "tests.statemachine.test_properties.TestRequestLifecycle"
    assert module_of(a_class) == "tests/statemachine/test_properties.py"
