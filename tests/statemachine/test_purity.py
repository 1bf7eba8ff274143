"""statemachine/ stays sans-IO: no I/O, clock, randomness or app imports (docs/design.md §9)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "statemachine"
FORBIDDEN = {
    "app",
    "asyncio",
    "sqlalchemy",
    "asyncpg",
    "starlette",
    "sse_starlette",
    "httpx",
    "aiohttp",
    "vllm",
    "prometheus_client",
    "time",
    "random",
    "socket",
    "os",
    "subprocess",
    "threading",
    "uuid",
    "secrets",
}


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__":
            roots.add("__import__")  # dynamic imports would dodge this test
    return roots


@pytest.mark.parametrize("path", sorted(PACKAGE.glob("*.py")), ids=lambda p: p.name)
def test_module_imports_nothing_impure(path: Path) -> None:
    assert not imported_roots(path) & (FORBIDDEN | {"__import__"})


def test_the_check_sees_a_forbidden_import(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("import time\nfrom app.store import x\nfrom asyncio import sleep\n")
    assert imported_roots(probe) >= {"time", "app", "asyncio"}


def test_the_package_has_modules() -> None:
    assert {p.name for p in PACKAGE.glob("*.py")} >= {"events.py", "phases.py", "state.py", "policy.py"}
