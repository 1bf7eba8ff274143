"""app/ imports only downward (docs/design.md §9), and no two of its modules import each other.

    cli → serve → gateway_process → gateway → api → driver → (store, replicas) → statemachine

and the worker, a process of its own, imports only ``app.contract``: the rules it and the
gateway must share (the worker token's, the engine inputs' checks), a leaf; and
``app.telemetry.logs``, the leaf that formats every phasegate process's lines; and
``app.http.server``, the HTTP server both run, with its cycle ``app.http.cycle``.

Every module under app/ belongs to a unit: a package (``app.driver``, ``app.api`` with its
rooms ``app.api.chat``, ``app.api.responses``, ``app.api.messages``, ``app.api.resume``…)
or a module (``app.cli``, ``app.process.serve``, ``app.telemetry.logs``): the process
plumbing (``app.process``), the HTTP server (``app.http``) and the telemetry
(``app.telemetry``) are packages of modules that are each a unit of their own.
``ALLOWED`` says which other units each one may import; the worker
is its own process and imports nothing of the gateway, least of all the log. Every
import counts, wherever it stands: one under ``if TYPE_CHECKING:`` or inside a function
is still an arrow. The cycle check follows the imports a module makes when it is loaded
or type-checked (its top level, ``TYPE_CHECKING`` blocks included), not the ones inside
functions.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support.imports import arrows, cycles, module_name, modules, reaches_itself

ROOT = Path(__file__).resolve().parents[2]
BOTTOM = "statemachine"

# The units each unit may import, besides itself. Downward only:
# test_the_table_runs_downward holds the table itself to that.
ALLOWED: dict[str, frozenset[str]] = {
    "app": frozenset(),  # app/__init__.py
    # the packages of the modules below: their __init__.py, empty
    "app.process": frozenset(),
    "app.http": frozenset(),
    "app.telemetry": frozenset(),
    # leaves: settings, the gateway's Prometheus metrics, child processes
    "app.config": frozenset({BOTTOM, "app.contract", "app.http.server", "app.discover_config", "app.config_tables"}),
    "app.config_tables": frozenset({BOTTOM}),  # the settings' tables, each checked
    "app.discover_config": frozenset(),  # [[discover]]'s tables, checked
    # reading the configuration again (SIGHUP), and `phasegate reload`; the data dir's default
    "app.process.reload": frozenset({"app.config", "app.store"}),
    "app.telemetry.metrics": frozenset(),
    "app.process.heap": frozenset(),  # freed heap memory handed back to the system
    "app.tasks": frozenset(),  # background loops stopped for sure
    # `phasegate replicas`: an HTTP client of the admin API; the embedded default's token
    "app.process.fleet_cli": frozenset({"app.store"}),
    "app.telemetry.logs": frozenset(),  # what a log line is about, its format, its redaction
    "app.telemetry.tracing": frozenset({BOTTOM}),  # OpenTelemetry, off unless configured; spans from the log's events
    "app.process.supervisor": frozenset({"app.contract"}),
    "app.process.start_signals": frozenset(),  # the stop and reload signals while serve starts
    # the HTTP server both processes run (uvicorn held to timeouts and a header limit),
    # and its request-response cycle (a stream's chunks, its head held for its first)
    "app.http.cycle": frozenset(),
    "app.http.server": frozenset({"app.http.cycle"}),
    # what the gateway and its workers must agree on; imports nothing
    "app.contract": frozenset(),
    # the replica process: never the log, the driver, the API or the gateway's clients
    "app.worker": frozenset({"app.contract", "app.telemetry.logs", "app.http.server"}),
    # the store and the replicas never import the driver, the API, or each other
    "app.store": frozenset({BOTTOM, "app.contract"}),  # the encoder that writes any depth a body may have
    "app.replicas": frozenset(
        {BOTTOM, "app.config", "app.discover_config", "app.contract", "app.telemetry.logs", "app.telemetry.tracing"}
        | {"app.tasks"}
    ),
    # replay and incident reports read the log
    "app.incident": frozenset({BOTTOM, "app.store"}),
    # the pages; the list of requests reads the read models' table
    "app.ui": frozenset({BOTTOM, "app.contract", "app.incident", "app.store"}),
    # observe -> decide -> act -> append; it returns what happened and the API renders it
    "app.driver": frozenset(
        {BOTTOM, "app.config", "app.contract", "app.telemetry.metrics", "app.store", "app.replicas", "app.tasks"}
    ),
    "app.api": frozenset(
        {
            BOTTOM,
            "app.config",
            "app.contract",
            "app.telemetry.metrics",
            "app.store",
            "app.driver",
            "app.incident",
            "app.ui",
        }
        | {
            "app.telemetry.logs",
            "app.telemetry.tracing",
            "app.http.server",
            "app.http.cycle",
        }  # the server's keys, its chunk writer
    ),
    # the composition root of one gateway, and the process that runs it
    "app.process.gateway": frozenset(
        {
            BOTTOM,
            "app.config",
            "app.telemetry.metrics",
            "app.store",
            "app.replicas",
            "app.driver",
            "app.api",
            "app.telemetry.tracing",
        }
        | {"app.discover_config", "app.process.heap", "app.tasks"}
    ),
    "app.process.gateway_process": frozenset(
        {"app.config", "app.process.gateway", "app.telemetry.logs", "app.telemetry.tracing", "app.http.server"}
    ),
    # the embedded default's simulated workers that join, and the banner
    "app.process.demo": frozenset({"app.config", "app.contract", "app.http.server", "app.process.supervisor"}),
    "app.process.serve": frozenset(
        {
            BOTTOM,
            "app.config",
            "app.telemetry.metrics",
            "app.process.supervisor",
            "app.store",
            "app.replicas",
            "app.driver",
            "app.api",
        }
        | {
            "app.process.gateway",
            "app.process.gateway_process",
            "app.contract",
            "app.telemetry.logs",
            "app.telemetry.tracing",
            "app.http.server",
        }
        | {"app.process.reload", "app.process.demo", "app.process.start_signals"}
    ),
}
ALLOWED["app.cli"] = frozenset({BOTTOM, *ALLOWED}) - {"app", "app.cli"}


def unit_of(module: str) -> str | None:
    """The unit of ``ALLOWED`` (or the bottom) that ``module`` belongs to, if any."""
    if module.split(".")[0] == BOTTOM:
        return BOTTOM
    fits = [unit for unit in ALLOWED if module == unit or module.startswith(unit + ".")]
    return max(fits, key=len, default=None)


def upward(path: Path, root: Path, known: set[str]) -> list[str]:
    """Each import in ``path`` that the table does not allow, as ``file:line: arrow``."""
    source = unit_of(module_name(path, root))
    found = []
    for arrow in sorted(arrows(path, root, known), key=lambda arrow: (arrow.line, arrow.target)):
        target = unit_of(arrow.target)
        if source is None or target is None or (target != source and target not in ALLOWED[source]):
            found.append(f"{arrow} (unit {source} may not import {target})")
    return found


APP_MODULES = modules(ROOT)


@pytest.mark.parametrize("path", APP_MODULES.values(), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_imports_only_downward(path: Path) -> None:
    violations = upward(path, ROOT, set(APP_MODULES))
    assert not violations, "imports that run up (docs/design.md §9):\n" + "\n".join(violations)


def test_no_import_cycles() -> None:
    found = cycles(ROOT)
    assert not found, "import cycles:\n" + "\n".join(" ; ".join(map(str, cycle)) for cycle in found)


def test_every_module_has_a_unit_and_every_unit_modules() -> None:
    assert {name: unit_of(name) for name in APP_MODULES if unit_of(name) is None} == {}
    assert {unit for unit in ALLOWED if unit not in APP_MODULES} == set()


def test_the_table_runs_downward() -> None:
    """No unit may import, directly or through others, a unit that may import it."""
    assert reaches_itself(ALLOWED) == []
    assert ALLOWED["app.worker"].isdisjoint({"app.store", "app.driver", "app.api"})
    for lower in ("app.store", "app.replicas"):
        assert ALLOWED[lower].isdisjoint({"app.driver", "app.api"})
    assert "app.api" not in ALLOWED["app.driver"]


def test_the_checks_see_upward_imports_and_cycles(tmp_path: Path) -> None:
    files = {
        "app/__init__.py": "",
        "app/api/__init__.py": "",
        "app/api/errors.py": "def body(): ...\n",
        "app/store/__init__.py": "",
        "app/store/log.py": (
            "from typing import TYPE_CHECKING\n"
            "from app.store import codec\n"
            "if TYPE_CHECKING:\n"
            "    from app.api.errors import body\n"
            "def late():\n"
            "    from ..api import errors\n"
            "    __import__('app.driver')\n"
        ),
        "app/store/codec.py": "from . import log\nimport statemachine.events\n",
        "app/worker/__init__.py": "",
        "app/worker/server.py": "def load():\n    from app.worker import server\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    known = set(modules(tmp_path))

    assert upward(tmp_path / "app/store/log.py", tmp_path, known) == [
        "app/store/log.py:4: app.store.log → app.api.errors (unit app.store may not import app.api)",
        "app/store/log.py:6: app.store.log → app.api.errors (unit app.store may not import app.api)",
        "app/store/log.py:7: app.store.log → app.driver (unit app.store may not import app.driver)",
    ]
    assert upward(tmp_path / "app/store/codec.py", tmp_path, known) == []
    # a function's import of its own module is no cycle; log <-> codec at load time is
    assert [[str(arrow) for arrow in cycle] for cycle in cycles(tmp_path)] == [
        ["app/store/codec.py:1: app.store.codec → app.store.log", "app/store/log.py:2: app.store.log → app.store.codec"]
    ]


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` names in an import statement (absolute imports; ops/ uses no others)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found


@pytest.mark.parametrize("path", sorted((ROOT / "ops").rglob("*.py")), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_ops_imports_no_tests(path: Path) -> None:
    # ops/ (benchmarks, seeding, fault scripts) builds on app/ and statemachine/; what it
    # shares with the tests lives in ops/ (ops/traces.py, ops/replication.py), never in tests/
    assert not [name for name in imported_modules(path) if name == "tests" or name.startswith("tests.")]
