"""The churn soak's memory check (ops/churn_check.py ``judge_rss``): growth from the first
quarter to the last fails a run long enough to be past its warm-up, and only such a run."""

from __future__ import annotations

from ops.churn_check import RSS_JUDGED_FROM_S, Sample, Verdict, judge_rss


def growing(seconds: float, first_kib: int, last_kib: int) -> list[Sample]:
    """One sample a second, the first half at ``first_kib`` and the rest at ``last_kib``,
    for the gateway that ran throughout and for a restarted one's second process."""
    steady = [Sample(0, 0, float(at), first_kib if at < seconds / 2 else last_kib) for at in range(int(seconds))]
    restarted = [Sample(1, 1, float(at), 50_000 + at * 100) for at in range(int(seconds / 2), int(seconds))]
    return steady + restarted


def judged(seconds: float, first_kib: int, last_kib: int) -> Verdict:
    verdict = Verdict()
    judge_rss(growing(seconds, first_kib, last_kib), seconds, verdict)
    return verdict


def test_growth_over_the_limit_fails_a_long_run() -> None:
    verdict = judged(RSS_JUDGED_FROM_S, 100_000, 115_000)
    assert verdict.failed["rss growth"] == 1 and not verdict.passed
    assert verdict.problems == ["rss growth: gateway 0: 100000 KiB in the first quarter, 115000 KiB in the last"]
    assert verdict.rss["gateway 0"] == [100_000, 100_000, 115_000, 115_000]
    assert verdict.rss["gateway 1 #2"][:2] == [None, None]  # the restarted process: shown, never judged


def test_growth_under_the_limit_passes_a_long_run() -> None:
    verdict = judged(RSS_JUDGED_FROM_S * 3, 100_000, 109_000)
    assert verdict.passed and verdict.problems == []


def test_a_short_run_shows_its_warm_up_and_does_not_judge_it() -> None:
    verdict = judged(120.0, 100_000, 115_000)
    assert verdict.passed and verdict.failed["rss growth"] == 0
    growth = "gateway 0: 100000 KiB in the first quarter, 115000 KiB in the last"
    assert verdict.problems == [f"note: {growth} (a 120 s run: its warm-up, not judged)"]
