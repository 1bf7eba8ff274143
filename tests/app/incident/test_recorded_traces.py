"""Traces recorded from a real gateway, through the incident tools and back into PostgreSQL.

Each one is imported with ``phasegate trace import``, exported again byte for byte,
replayed offline and from the log without divergence, and the read models the import
projected agree with the fold of its events (``app.store.audit``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.app.incident.conftest import Runner
from tests.support.audit import fold_disagreements_in, read_model_row

RECORDED = Path(__file__).resolve().parents[2] / "traces" / "recorded"


@pytest.mark.parametrize("path", sorted(RECORDED.glob("*.jsonl")), ids=lambda p: p.stem)
def test_a_recorded_trace_round_trips_through_the_log_and_its_read_models_agree(
    phasegate: Runner, database_url: str, path: Path, tmp_path: Path
) -> None:
    recorded = path.read_text()
    header = json.loads(recorded.splitlines()[0])
    (request_id,) = header["requests"]
    imported = phasegate("trace", "import", str(path))
    assert imported.status == 0, imported.err
    exported = tmp_path / "exported.jsonl"
    meta = [arg for key in ("source", "scenario") for arg in ("--meta", f"{key}={header[key]}")]
    ran = phasegate("trace", "export", request_id, "-o", str(exported), *meta)
    assert ran.status == 0, ran.err
    assert exported.read_text() == recorded
    for target in (str(path), request_id):  # offline from the file, then from the log
        replayed = phasegate("replay", target)
        assert replayed.status == 0, replayed.out + replayed.err
        assert "no divergence" in replayed.out
    assert fold_disagreements_in(database_url) == []
    assert read_model_row(database_url, request_id)["outcome"] is not None
