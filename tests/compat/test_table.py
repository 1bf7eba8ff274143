"""docs/compatibility.md and the differential suite cover every field vLLM declares.

No engine is needed: this reads the field table (app/contract/request_fields.py), the
suite's cases and divergences, and the page, so a field added to the table without a case
or a line on the page, or a divergence the page does not name, fails here at once.
"""

from __future__ import annotations

import re
from pathlib import Path

from app.contract.request_fields import OWN, RECORDED, WHOLE_ONLY
from app.contract.requests import PASSED_CHAT, PASSED_COMPLETIONS
from tests.compat.test_differential import CASES, DIVERGENCES, WORKER_DIVERGENCES

PAGE = (Path(__file__).parents[2] / "docs" / "compatibility.md").read_text()
# refused before a replica sees them, and shown by tests/app/api/test_schemas.py
REFUSED = set(OWN) | set(WHOLE_ONLY) - {"prompt_logprobs"}


def test_every_declared_field_is_on_the_page() -> None:
    named = set(re.findall(r"`([a-z_]+)`", PAGE))
    fields = PASSED_CHAT | PASSED_COMPLETIONS | set(OWN) | set(WHOLE_ONLY) | RECORDED
    assert sorted(fields - named) == []


def test_every_passed_on_field_has_a_case() -> None:
    sent = {key for _, body in CASES.values() for key in body}
    assert sorted((PASSED_CHAT | PASSED_COMPLETIONS | RECORDED | set(WHOLE_ONLY)) - sent - REFUSED) == []


def test_every_case_and_divergence_is_on_the_page() -> None:
    cases = {name for name, _ in (*DIVERGENCES, *WORKER_DIVERGENCES)}
    assert cases <= set(CASES)
    missing = [name for name in sorted(cases) if f"*{name}*" not in PAGE and f"*{name}" not in PAGE]
    assert missing == []
