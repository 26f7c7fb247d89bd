"""How much of the possible overlap asynchronous training achieved: notebook 07 and `bench/async_vs_sync.py`.

Design decisions:
- A comparison is made of runs, never of one run per mode. Step times on a shared machine move from run to run
  (`bench/async_vs_sync.py` records by how much), so each mode runs several times (interleaved: sync, async, sync, ...;
  a slow spell of the machine then hits both) and every number is reported with its spread (lowest and highest run).
- The ideal comes from the synchronous runs' own phases: g = generation, t = training (recompute + update + weight
  sync) per step, ideal = (g + t) / max(g, t). Achieved = sync step / async step, paired run by run.
- Equal work is the caller's job: fixed-length generations (`min_new_tokens = max_new_tokens`), the same prompts in
  the same order (same seed), the same number of steps. The first `skip` steps of every run are warm-up and left out.
- The verdict is arithmetic, not hope: achieved may exceed the ideal only by the two spreads together. A larger
  excess means the runs did not do the same work, or the machine's speed moved between them by more than the spreads
  caught (a slow spell during the synchronous runs only), and the report says so, not a percentage above 100.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence

__all__ = ["Spread", "OverlapReport", "compare_runs"]

TRAIN_PHASES = ("time/logp", "time/update", "time/weight_sync")


@dataclass(frozen=True)
class Spread:
    """The mean of a few runs' values and their range."""

    mean: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> "Spread":
        if not values:
            raise ValueError("no runs to summarise")
        return cls(sum(values) / len(values), min(values), max(values))

    @property
    def noise(self) -> float:
        """Half the range: how far one run's value may sit from the mean."""
        return (self.high - self.low) / 2

    def __format__(self, spec: str) -> str:
        spec = spec or ".2f"
        return f"{self.mean:{spec}} ({self.low:{spec}}-{self.high:{spec}})"


def _mean(rows: Sequence[Dict[str, float]], keys: Sequence[str]) -> float:
    return sum(sum(float(r[k]) for k in keys) for r in rows) / len(rows)


@dataclass(frozen=True)
class OverlapReport:
    """Per-step means over runs: generation g, training t, step times, the ideal and achieved speed-ups."""

    runs: int
    steps_measured: int
    g: Spread
    t: Spread
    sync_step: Spread
    async_step: Spread
    ideal: Spread
    achieved: Spread

    @property
    def within_ideal(self) -> bool:
        """Achieved is at most the ideal, up to the noise of both."""
        return self.achieved.mean <= self.ideal.mean + self.achieved.noise + self.ideal.noise

    def lines(self) -> List[str]:
        head = f"{self.runs} runs per mode, {self.steps_measured} measured steps each; mean (lowest-highest run)"
        verdict = (
            "achieved <= ideal, within the noise: yes"
            if self.within_ideal
            else "achieved exceeds the ideal beyond the noise: the two modes did not do the same work, or the "
            "machine's speed changed between their runs (run them again)"
        )
        return [
            head,
            f"sync:  generate g = {self.g:.1f} s, train t = {self.t:.1f} s, step {self.sync_step:.1f} s",
            f"async: step {self.async_step:.1f} s",
            f"ideal speed-up (g + t) / max(g, t) = {self.ideal:.2f}x",
            f"achieved speed-up sync / async     = {self.achieved:.2f}x",
            verdict,
        ]


def compare_runs(
    sync_runs: Sequence[Sequence[Dict[str, float]]], async_runs: Sequence[Sequence[Dict[str, float]]], skip: int = 1
) -> OverlapReport:
    """Summarise paired runs (per-step stats as `kit.trainer.train.train` returns them), leaving out `skip` warm-up
    steps."""
    if len(sync_runs) != len(async_runs) or not sync_runs:
        raise ValueError(f"need the same number of runs per mode, got {len(sync_runs)} and {len(async_runs)}")
    sync = [list(run)[skip:] for run in sync_runs]
    asyn = [list(run)[skip:] for run in async_runs]
    if any(not run for run in sync + asyn):
        raise ValueError(f"every run needs more than {skip} step(s): the first {skip} are warm-up")
    g = [_mean(run, ["time/generate"]) for run in sync]
    t = [_mean(run, TRAIN_PHASES) for run in sync]
    s = [_mean(run, ["time/step"]) for run in sync]
    a = [_mean(run, ["time/step"]) for run in asyn]
    return OverlapReport(
        runs=len(sync),
        steps_measured=min(len(run) for run in sync + asyn),
        g=Spread.of(g),
        t=Spread.of(t),
        sync_step=Spread.of(s),
        async_step=Spread.of(a),
        ideal=Spread.of([(gi + ti) / max(gi, ti) for gi, ti in zip(g, t)]),
        achieved=Spread.of([si / ai for si, ai in zip(s, a)]),
    )
