"""Imports read from source (ast), for the layering tests of app/ and statemachine/.

``arrows`` gives each import a module makes, resolved to module names; ``cycles`` the
import cycles among a package's modules. Only the imports a module makes when it is
loaded or type-checked (its top level, ``TYPE_CHECKING`` blocks included) close a cycle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

TOP = ("app", "statemachine")  # the packages whose imports are followed


@dataclass(frozen=True)
class Arrow:
    """One import: ``source`` (a module of app/) imports ``target`` at ``file:line``."""

    source: str
    target: str
    file: str
    line: int
    loaded: bool  # at the top level or under TYPE_CHECKING, not inside a function

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.source} → {self.target}"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path, package: str = "app") -> dict[str, Path]:
    """Every module under ``root``/``package``, by dotted name."""
    return {module_name(path, root): path for path in sorted((root / package).rglob("*.py"))}


def _package(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _walk(body: list[ast.stmt], loaded: bool) -> Iterator[tuple[ast.AST, bool]]:
    """Every node under ``body``, with whether it runs when the module is loaded."""
    for statement in body:
        stack: list[tuple[ast.AST, bool]] = [(statement, loaded)]
        while stack:
            node, at_load = stack.pop()
            yield node, at_load
            inner = at_load and not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            stack.extend((child, inner) for child in ast.iter_child_nodes(node))


def arrows(path: Path, root: Path, known: set[str]) -> Iterator[Arrow]:
    """The imports of app/ or statemachine/ that ``path`` makes, resolved to module names.

    ``from app.store import schema`` names the module ``app.store.schema`` when it is one
    (``known``); relative imports are resolved against the module's package; a constant
    string given to ``importlib.import_module`` or ``__import__`` counts as an import.
    """
    source = module_name(path, root)
    package = _package(source, path)
    file = path.relative_to(root).as_posix()
    tree = ast.parse(path.read_text(), filename=str(path))
    for node, loaded in _walk(tree.body, loaded=True):
        if not isinstance(node, ast.Import | ast.ImportFrom | ast.Call):
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                stem = ".".join([*base, node.module] if node.module else base)
            else:
                stem = node.module or ""
            targets = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in known else stem for a in node.names]
        elif node.args and isinstance(node.args[0], ast.Constant):
            called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                targets = [node.args[0].value]
        for target in dict.fromkeys(targets):
            if target.split(".")[0] in TOP:
                yield Arrow(source, target, file, node.lineno, loaded)


def cycles(root: Path, package: str = "app") -> list[list[Arrow]]:
    """Import cycles among the modules of ``package``, one per strongly connected set.

    Only arrows that run when a module is loaded or type-checked count; each cycle is
    given as the arrows that close it, starting from its first module by name.
    """
    known = modules(root, package)
    graph: dict[str, dict[str, Arrow]] = {name: {} for name in known}
    for name, path in known.items():
        for arrow in arrows(path, root, set(known)):
            if arrow.loaded and arrow.target in graph and arrow.target not in graph[name]:
                graph[name][arrow.target] = arrow

    # Tarjan's strongly connected components; the graph is small enough for recursion.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for successor in graph[node]:
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                components.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)

    found = []
    for component in sorted(components):
        members = set(component)
        start = component[0]
        # a shortest way from start back to itself inside the component
        paths: dict[str, list[Arrow]] = {start: []}
        frontier = [start]
        closing: list[Arrow] | None = None
        while frontier and closing is None:
            following = []
            for node in frontier:
                for successor, arrow in sorted(graph[node].items()):
                    if successor == start:
                        closing = [*paths[node], arrow]
                        break
                    if successor in members and successor not in paths:
                        paths[successor] = [*paths[node], arrow]
                        following.append(successor)
                if closing is not None:
                    break
            frontier = following
        assert closing is not None
        found.append(closing)
    return found


def reaches_itself(table: Mapping[str, frozenset[str]]) -> list[str]:
    """The units of a layering table that can import themselves through the others."""
    found = []
    for unit in table:
        reachable: set[str] = set()
        frontier = set(table[unit])
        while frontier:
            reachable |= frontier
            frontier = {below for above in frontier for below in table.get(above, ())} - reachable
        if unit in reachable:
            found.append(unit)
    return found
