"""The global retry budget: a token bucket on an injected clock."""

from __future__ import annotations

import pytest

from app.driver.budget import RetryBudget


def test_the_bucket_spends_its_burst_then_refills_at_its_rate() -> None:
    now = [0.0]
    budget = RetryBudget(burst=2, per_second=0.5, clock=lambda: now[0])
    assert [budget.try_take() for _ in range(3)] == [True, True, False]
    now[0] += 1.0
    assert not budget.try_take()  # half a token
    now[0] += 1.0
    assert budget.try_take()
    now[0] += 100.0
    assert budget.available == 2  # never above the burst


def test_a_negative_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="must not be negative"):
        RetryBudget(burst=-1, per_second=1)
