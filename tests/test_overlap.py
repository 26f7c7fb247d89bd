"""The overlap report of notebook 07 and bench/async_vs_sync.py: ideal from the sync phases, spreads, the verdict."""

from __future__ import annotations

import pytest

from areal_lite.kit.notebook.overlap import Spread, compare_runs


def run(generate, train, step, steps=3, warmup=100.0):
    """Per-step stats of one run: a slow first step (warm-up), then `steps` equal ones."""
    first = {"time/generate": warmup, "time/logp": 0.0, "time/update": warmup, "time/weight_sync": 0.0}
    rest = {"time/generate": generate, "time/logp": train / 4, "time/update": train / 2, "time/weight_sync": train / 4}
    return [dict(first, **{"time/step": warmup})] + [dict(rest, **{"time/step": step}) for _ in range(steps)]


def test_ideal_and_achieved_come_from_paired_runs_without_warmup():
    sync = [run(4.0, 6.0, 10.0), run(4.0, 6.0, 12.0)]
    asyn = [run(1.0, 6.0, 8.0), run(1.0, 6.0, 8.0)]
    report = compare_runs(sync, asyn)
    assert report.runs == 2 and report.steps_measured == 3
    assert report.g == Spread(4.0, 4.0, 4.0) and report.t == Spread(6.0, 6.0, 6.0)
    assert report.ideal.mean == pytest.approx(10 / 6)
    assert (report.achieved.low, report.achieved.high) == (pytest.approx(1.25), pytest.approx(1.5))
    assert report.within_ideal
    assert "1.38 (1.25-1.50)x" in "\n".join(report.lines())


def test_an_excess_beyond_the_noise_is_called_unequal_work():
    # Async steps shorter than the sync run's training phase alone: impossible for equal work.
    report = compare_runs([run(3.0, 10.0, 13.0)] * 3, [run(0.5, 5.0, 6.0)] * 3)
    assert report.achieved.mean > report.ideal.mean and not report.within_ideal
    assert "did not do the same work" in report.lines()[-1]


def test_noise_is_allowed_for():
    sync = [run(5.0, 5.0, 10.0), run(5.0, 5.0, 10.0), run(5.0, 5.0, 10.0)]
    asyn = [run(1.0, 5.0, 4.6), run(1.0, 5.0, 5.4), run(1.0, 5.0, 5.8)]  # one lucky run above the ideal of 2
    report = compare_runs(sync, asyn)
    assert report.achieved.high > report.ideal.mean and report.within_ideal


def test_clear_errors():
    with pytest.raises(ValueError, match="same number of runs"):
        compare_runs([run(1, 1, 2)], [])
    with pytest.raises(ValueError, match="warm-up"):
        compare_runs([run(1, 1, 2, steps=0)], [run(1, 1, 2, steps=0)])
