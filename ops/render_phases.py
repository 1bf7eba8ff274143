"""Write docs/phases.md from the transition table: `python ops/render_phases.py`."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from statemachine.diagram import render_phases_markdown

TARGET = Path(__file__).resolve().parents[1] / "docs" / "phases.md"

if __name__ == "__main__":
    TARGET.parent.mkdir(exist_ok=True)
    TARGET.write_text(render_phases_markdown())
    print(f"wrote {TARGET}")
