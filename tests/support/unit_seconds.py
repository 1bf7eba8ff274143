"""Write tests/support/unit_seconds.json from a full run's JUnit XML (``pytest
--junitxml=FILE``, e.g. ``PYTEST_ADDOPTS=--junitxml=/tmp/run.xml bash .ci/run``): per test
module, its tests and the seconds they took (setup and teardown included), which the
scheduler (tests/support/scheduling.py) orders the units by.

    python -m tests.support.unit_seconds /tmp/run.xml
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ElementTree
from collections import defaultdict
from pathlib import Path

from tests.support.scheduling import SECONDS

ROOT = Path(__file__).resolve().parents[2]


def module_of(classname: str) -> str:
    """The module path of a JUnit ``classname`` (``tests.a.test_b`` or ``tests.a.test_b.Class``)."""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        path = "/".join(parts[:end]) + ".py"
        if (ROOT / path).exists():
            return path
    raise ValueError(f"no module for {classname!r}")


def table(junit: Path) -> dict[str, dict[str, float]]:
    modules: dict[str, dict[str, float]] = defaultdict(lambda: {"tests": 0, "seconds": 0.0})
    for case in ElementTree.parse(junit).iter("testcase"):
        module = modules[module_of(case.get("classname", ""))]
        module["tests"] += 1
        module["seconds"] += float(case.get("time") or 0.0)
    return {path: {"tests": m["tests"], "seconds": round(m["seconds"], 1)} for path, m in sorted(modules.items())}


if __name__ == "__main__":
    written = table(Path(sys.argv[1]))
    SECONDS.write_text(json.dumps(written, indent=1) + "\n")
    print(f"{SECONDS}: {len(written)} modules, {sum(m['seconds'] for m in written.values()):.0f} s")
