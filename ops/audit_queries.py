"""The queries of docs/audit.md, as its test and its benchmark read them.

Each is a numbered ``## N. Title`` section with one ```` ```sql ```` block; psql's
``:'name'`` variables become numbered parameters (:func:`bind`). Read by
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


def doc_queries(doc: Path = DOC) -> dict[int, tuple[str, str]]:
    """Every numbered query of the document: number -> (title, SQL)."""
    return {int(number): (title, sql) for number, title, sql in QUERY.findall(doc.read_text())}


def bind(sql: str, parameters: Mapping[str, Any]) -> tuple[str, list[Any]]:
    """psql's ``:'name'`` variables as numbered parameters, and their values in order."""
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(1) not in names:
            names.append(match.group(1))
        return f"${names.index(match.group(1)) + 1}"

    return re.sub(r":'(\w+)'", number, sql), [parameters[name] for name in names]
