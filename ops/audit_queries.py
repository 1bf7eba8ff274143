"""The queries of docs/audit.md, as its test and its benchmark read them.

Each is a numbered ``## N. Title`` section with one ```` ```sql ```` block; psql's
``:'name'`` variables become numbered parameters (:func:`bind`). The bounded forms of
the queries too slow on a large log are ``### N. bounded`` sections, each with the
indexes it needs as ``-- with: CREATE INDEX …`` lines. Read by
``tests/app/store/test_audit_queries.py`` (each query against a log it expects) and
``ops/bench/audit.py`` (each timed on a seeded one), so neither keeps its own copy.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

DOC = Path(__file__).resolve().parents[1] / "docs" / "audit.md"
QUERY = re.compile(r"^## (\d+)\. (.+?)\n.*?^```sql\n(.*?)^```", re.MULTILINE | re.DOTALL)
BOUNDED = re.compile(r"^### (\d+)\. bounded\n.*?^```sql\n(.*?)^```", re.MULTILINE | re.DOTALL)
WITH = "-- with: "


def doc_queries(doc: Path = DOC) -> dict[int, tuple[str, str]]:
    """Every numbered query of the document: number -> (title, SQL)."""
    return {int(number): (title, sql) for number, title, sql in QUERY.findall(doc.read_text())}


def bounded_queries(doc: Path = DOC) -> dict[int, tuple[str, list[str]]]:
    """The bounded forms ("At ten million events"): number -> (SQL, the indexes it needs,
    from its ``-- with:`` lines)."""
    found = {}
    for number, block in BOUNDED.findall(doc.read_text()):
        lines = block.splitlines(keepends=True)
        indexes = [line.removeprefix(WITH).strip() for line in lines if line.startswith(WITH)]
        found[int(number)] = ("".join(line for line in lines if not line.startswith(WITH)), indexes)
    return found


def index_name(create_index: str) -> str:
    """The name a ``CREATE INDEX name ON …`` statement gives."""
    match = re.match(r"CREATE (?:UNIQUE )?INDEX (\w+) ON ", create_index)
    if match is None:
        raise ValueError(f"not a named CREATE INDEX: {create_index}")
    return match.group(1)


def bind(sql: str, parameters: Mapping[str, Any]) -> tuple[str, list[Any]]:
    """psql's ``:'name'`` variables as numbered parameters, and their values in order."""
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(1) not in names:
            names.append(match.group(1))
        return f"${names.index(match.group(1)) + 1}"

    return re.sub(r":'(\w+)'", number, sql), [parameters[name] for name in names]
