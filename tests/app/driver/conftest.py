"""Fixtures of the driver's tests."""

from __future__ import annotations

import pytest

from app.driver import fleet


@pytest.fixture
def heard_by_notify_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The membership's periodic re-read put off (every ``RESYNC_S``): a fleet change that
    reaches another gateway instance in the test was heard by NOTIFY, however long a loaded
    machine took (docs/performance.md measures how long it takes on a quiet one)."""
    monkeypatch.setattr(fleet, "RESYNC_S", 3600.0)
