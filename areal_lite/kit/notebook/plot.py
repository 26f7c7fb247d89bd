"""Plots of training statistics: reward curves, response lengths, where the time goes, sync vs async.

Design decisions
- Input is what `train.py` writes: a list of per-step dicts, or the path of a JSONL file with one dict per line.
  Keys are looked up by a short list of accepted names (`reward`, `rollout/reward`, ...), so statistics from a
  notebook loop that names things slightly differently still plot; a missing key is a clear error naming the keys
  that exist.
- Every function returns the matplotlib Figure and takes an optional `ax`, so notebooks show it inline (the
  figure is the cell's value) and scripts call `save_png(fig, path)`. No `plt.show()` anywhere.
- The backend is only forced to Agg when there is no display and matplotlib has not been imported with another
  backend yet (Jupyter's inline backend is left alone).
- Smoothing is an exponential moving average with bias correction (TensorBoard's), so the first points are not
  dragged toward zero.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

__all__ = [
    "load_stats",
    "smooth",
    "plot_rewards",
    "plot_response_length",
    "plot_time_breakdown",
    "plot_sync_vs_async",
    "save_png",
    "plot_turns",
]

Stats = Union[str, os.PathLike, Sequence[Dict[str, Any]]]

# Accepted names, first match wins.
REWARD_KEYS = ("reward", "rollout/reward", "task_reward", "rewards")
ACCURACY_KEYS = ("eval_accuracy", "eval/accuracy", "accuracy")
LENGTH_KEYS = ("response_length", "rollout/response_length", "seqlen", "response_len")
TURN_KEYS = ("turns", "rollout/turns", "mean_turns")
PHASES = (  # (label, accepted keys)
    ("generate", ("time/generate", "generate_time", "time_generate", "rollout_time")),
    ("logp", ("time/logp", "logp_time", "time_logp")),
    ("update", ("time/update", "update_time", "time_update", "train_time")),
    ("weight sync", ("time/weight_sync", "weight_sync_time", "time_weight_sync", "sync_time")),
)
STEP_TIME_KEYS = ("time/step", "step_time", "time_step")


def _pyplot():
    import matplotlib

    if "matplotlib.pyplot" not in __import__("sys").modules:
        no_display = os.name != "nt" and not os.environ.get("DISPLAY") and not os.environ.get("WAYLAND_DISPLAY")
        in_notebook = "ipykernel" in __import__("sys").modules
        if no_display and not in_notebook:
            matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def load_stats(stats: Stats) -> List[Dict[str, Any]]:
    """A list of per-step dicts from a list (returned as a list) or a JSONL path (blank lines skipped)."""
    if isinstance(stats, (str, os.PathLike)):
        rows = []
        with open(stats, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{stats}:{n}: not a JSON line ({e})") from None
        return rows
    rows = list(stats)
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise TypeError(f"stats[{i}] is a {type(row).__name__}; expected a dict of per-step values")
    return rows


def _key(rows: Sequence[Dict[str, Any]], names: Iterable[str], what: str, required: bool = True) -> Optional[str]:
    names = tuple(names)
    for name in names:
        if any(name in r and r[name] is not None for r in rows):
            return name
    if required:
        present = sorted({k for r in rows for k in r})
        raise KeyError(f"no {what} in the stats (looked for {list(names)}; keys present: {present})")
    return None


def _series(rows, key) -> tuple[list, list]:
    xs, ys = [], []
    for i, r in enumerate(rows):
        v = r.get(key)
        if v is None:
            continue
        xs.append(r.get("step", i))
        ys.append(float(v))
    return xs, ys


def smooth(values: Sequence[float], weight: float = 0.6) -> List[float]:
    """Bias-corrected exponential moving average (weight in [0, 1); 0 = no smoothing)."""
    if not 0 <= weight < 1:
        raise ValueError(f"smoothing weight must be in [0, 1), got {weight}")
    out, avg = [], 0.0
    for n, v in enumerate(values, 1):
        avg = weight * avg + (1 - weight) * v
        out.append(avg / (1 - weight**n))
    return out


def _axes(ax, figsize=(6, 3.5)):
    plt = _pyplot()
    if ax is None:
        fig, ax = plt.subplots(figsize=figsize)
    else:
        fig = ax.figure
    return fig, ax


def _curve(
    ax,
    rows,
    keys: Sequence[str],
    what: str,
    smoothing: float,
    legend: bool = True,
    n: Optional[int] = None,
    name: Optional[str] = None,
) -> list:
    """One statistic per step: its points and their smoothed line (the per-step values of RL are noisy).
    `n`: how many episodes each point averages, written into the label (an estimate is read with its n); `name`:
    what the legend calls the statistic (default: its key)."""
    key = _key(rows, keys, what)
    xs, ys = _series(rows, key)
    name = name or key
    per_step = f"{name} (per step, n={n})" if n else f"{name} (per step)"
    # the points above the line: a smoothed line starts on the first point and would hide it
    ax.plot(xs, ys, "o", alpha=0.6, ms=4, zorder=3, label=per_step if legend else None)
    smoothed = f"{name} (moving average, weight {smoothing:g})"
    ax.plot(xs, smooth(ys, smoothing), "-", lw=2, zorder=2, label=smoothed if legend else None)
    return ys


def _integer_steps(ax) -> None:
    """Steps are whole numbers: no tick at 0.5 on a three-step run."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


STEP_UPDATES = "step (updates done)"  # where held-out markers sit at "after k updates" beside step k


def _finish(fig, ax, ylabel: str, title: str, legend: bool = True, xlabel: str = "step"):
    _integer_steps(ax)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_rewards(
    stats: Stats,
    ax=None,
    smoothing: float = 0.6,
    title: str = "Reward",
    evals: Optional[Sequence[Tuple[float, float]]] = None,
    eval_label: str = "held-out",
    eval_n: Optional[int] = None,
    ylabel: str = "training reward",
    eval_axis: Optional[str] = None,
    train_n: Optional[int] = None,
    train_label: Optional[str] = None,
):
    """Mean rollout reward per step (points + smoothed line), and held-out evaluations as separate markers.

    The evaluation comes from `evals`, (updates done, value) pairs such as `[(0, before), (len(history), after)]`,
    or else from the rows' `eval_accuracy` keys as `python -m areal_lite.kit.trainer.train` writes them (greedy
    accuracy).
    Held-out points are a few measurements, not a trend: they are drawn as markers with their value written next
    to them, never joined by a line, and `eval_n` (the number of held-out problems) goes into their label. The
    x-axis then reads "step (updates done)": step k is taken after k updates, and a marker at k measures the model
    those k updates made.
    `eval_axis`: a y-axis label for the evaluations puts them on their own axis on the right, for when they measure
    something else than the training reward (an accuracy in [0, 1] next to a return in [-1.75, 1]).
    `train_n`: episodes per training step, written into the curve's label; `train_label`: the curve's name there.
    Rewards in [0, 1] get the whole [0, 1] axis, so that a rise from 0.1 to 0.3 does not look like one from 0 to 1.
    """
    rows = load_stats(stats)
    fig, ax = _axes(ax)
    ys = _curve(ax, rows, REWARD_KEYS, "reward", smoothing, n=train_n, name=train_label)
    if ys and 0 <= min(ys) and max(ys) <= 1 and not eval_axis:
        ax.set_ylim(-0.05, 1.1)
    points, label = list(evals or []), eval_label
    acc = _key(rows, ACCURACY_KEYS, "accuracy", required=False)
    if not points and acc:
        # train.py measures `eval_accuracy` after the row's update and `eval_accuracy_before` before any: draw both
        # at "updates done", so the first point is the untrained model.
        for i, r in enumerate(rows):
            if r.get("eval_accuracy_before") is not None:
                points.append((r.get("step", i), float(r["eval_accuracy_before"])))
            if r.get(acc) is not None:
                points.append((r.get("step", i) + (1 if acc == "eval_accuracy" else 0), float(r[acc])))
        label = f"{acc} (greedy, held-out)"
    if points:
        target = ax.twinx() if eval_axis else ax
        if eval_n is not None:
            label = f"{label}, n={eval_n}"
        xs, ys = [float(x) for x, _ in points], [float(y) for _, y in points]
        target.plot(xs, ys, "s", ls="none", ms=7, color="C3", label=label)
        for x, y in zip(xs, ys):
            target.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(6, 4), fontsize=8, color="C3")
        lo, hi = ax.get_xlim()
        ax.set_xlim(lo, max(hi, max(xs) + 1.0))  # room for the last point's value on its right
        if eval_axis:
            target.set_ylabel(eval_axis, color="C3")
            target.set_ylim(-0.05, 1.1)
            handles = ax.get_legend_handles_labels()[0] + target.get_legend_handles_labels()[0]
            fig = _finish(fig, ax, ylabel, title, legend=False, xlabel=STEP_UPDATES)
            # below the axes: inside, it would hide points of one curve or the other
            ax.legend(
                handles, [h.get_label() for h in handles], fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2)
            )
            fig.tight_layout()
            return fig
    return _finish(fig, ax, ylabel, title, xlabel=STEP_UPDATES if points else "step")


def plot_response_length(
    stats: Stats, ax=None, smoothing: float = 0.6, title: str = "Response length", n: Optional[int] = None
):
    """Mean generated tokens per response, per step (`n`: episodes per step), on an axis from 0: a change of two
    tokens in forty is drawn as the small change it is."""
    rows = load_stats(stats)
    fig, ax = _axes(ax)
    _curve(ax, rows, LENGTH_KEYS, "response length", smoothing, n=n, name="generated tokens")
    ax.set_ylim(bottom=0)
    return _finish(fig, ax, "generated tokens per episode", title)


def plot_time_breakdown(stats: Stats, ax=None, title: str = "Time per step", generate_label: str = "generate"):
    """Stacked bars per step: generate / logp / update / weight sync (seconds); phases absent, or under 1% of the
    tallest bar at every step (a recompute that took microseconds: no bar to see), are left out of the bars and the
    legend. `generate_label` names the first phase: in an asynchronous run it is the time the trainer waited for
    rollouts, not the time generation took.

    When the stats carry the step's wall time, it is drawn as a line: in asynchronous training generation overlaps
    training, so the bars can add up to more than the step took.
    """
    rows = load_stats(stats)
    fig, ax = _axes(ax, figsize=(7, 3.5))
    steps = [r.get("step", i) for i, r in enumerate(rows)]
    phases = []
    for label, names in PHASES:
        key = _key(rows, names, label, required=False)
        if key is not None:
            phases.append((label, [float(r.get(key) or 0.0) for r in rows]))
    tallest = max((sum(step) for step in zip(*(vals for _, vals in phases))), default=0.0)
    phases = [(label, vals) for label, vals in phases if max(vals) > 0.01 * tallest]
    if not phases:
        raise KeyError(f"no phase times in the stats (looked for {[n for _, ns in PHASES for n in ns]})")
    bottom = [0.0] * len(rows)
    for label, vals in phases:
        ax.bar(steps, vals, bottom=bottom, label=generate_label if label == "generate" else label, width=0.8)
        bottom = [b + v for b, v in zip(bottom, vals)]
    wall = _key(rows, STEP_TIME_KEYS, "step time", required=False)
    if wall:
        ax.plot(*_series(rows, wall), "k.-", label="step wall time")
    _integer_steps(ax)
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.set_title(title)
    # beside the axes, not on them: inside, "best" still covered a tall first bar (the step that warms up)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig


def plot_sync_vs_async(
    sync_stats, async_stats, title: str = "Synchronous vs asynchronous", skip: int = 1, show_reward: bool = True
):
    """Two panels: step wall time per step for both modes, and reward against cumulative wall time (`show_reward`;
    without it, the step times alone).

    Each side is one run's stats or a list of runs (several runs are drawn as thin lines of one colour). The legend's
    mean is over every run's steps after the first `skip` (warm-up): the number `kit.notebook.overlap.compare_runs`
    reports, so a legend and a printed line never disagree.
    """
    plt = _pyplot()
    if show_reward:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    else:
        fig, ax1 = plt.subplots(figsize=(6, 3.5))
        ax2 = None
    for colour, (name, stats) in zip(("C0", "C1"), (("sync", sync_stats), ("async", async_stats))):
        runs = _as_runs(stats)
        means = []
        for i, rows in enumerate(runs):
            wall = _key(rows, STEP_TIME_KEYS, f"step time ({name})")
            xs, ys = _series(rows, wall)
            measured = ys[skip:] or ys
            means.append(sum(measured) / len(measured))
            ax1.plot(xs, ys, "o-", color=colour, lw=1.5 if len(runs) == 1 else 1, alpha=1 if len(runs) == 1 else 0.6)
            rkey = ax2 is not None and _key(rows, REWARD_KEYS, f"reward ({name})", required=False)
            if rkey:
                elapsed = [sum(ys[: k + 1]) for k in range(len(ys))]
                rewards = [float(r[rkey]) for r in rows if r.get(wall) is not None]
                ax2.plot(elapsed, smooth(rewards), "-", color=colour, label=name if i == 0 else None)
        runs_text = f", {len(runs)} runs" if len(runs) > 1 else ""
        ax1.plot(
            [], [], "o-", color=colour, label=f"{name}: mean {sum(means) / len(means):.1f} s (steps {skip}+{runs_text})"
        )
    _integer_steps(ax1)
    ax1.set_xlabel("step")
    ax1.set_ylabel("seconds per step")
    ax1.set_title("step time")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    if ax2 is not None:
        ax2.set_xlabel("wall time (s)")
        ax2.set_ylabel("training reward (smoothed)")
        ax2.set_title("reward vs time")
        ax2.grid(alpha=0.3)
        if ax2.lines:
            ax2.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def _as_runs(stats) -> List[List[Dict[str, Any]]]:
    """One run (a list of per-step dicts or a JSONL path) or a list of runs -> a list of runs."""
    if isinstance(stats, (list, tuple)) and stats and isinstance(stats[0], (list, tuple, str, os.PathLike)):
        return [load_stats(run) for run in stats]
    return [load_stats(stats)]


def save_png(fig, path: Union[str, os.PathLike], dpi: int = 110) -> str:
    """Write the figure to `path` (folders created), close it, return the path."""
    path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    _pyplot().close(fig)
    return path


def plot_turns(
    stats: Stats,
    ax=None,
    smoothing: float = 0.6,
    max_turns: Optional[int] = None,
    title: str = "Turns per episode",
    n: Optional[int] = None,
):
    """Mean answers per episode, per step (points + smoothed line), for agents that may answer several times.

    A row's `turns` is the mean over the step's episodes of the answers up to the first correct one (the whole
    budget when none was). Dotted lines mark 1 (every episode right at the first try) and `max_turns` (none right).
    `n`: the episodes each step's mean is over, written into the legend. The x-axis reads "step (updates done)", as
    `plot_rewards`' beside it: step k's episodes come from the model k updates made.
    """
    rows = load_stats(stats)
    fig, ax = _axes(ax)
    _curve(ax, rows, TURN_KEYS, "turn count", smoothing, n=n)
    ax.axhline(1, ls=":", color="gray", lw=1)
    if max_turns is not None:
        ax.axhline(max_turns, ls=":", color="gray", lw=1)
        ax.set_ylim(0.9, max_turns + 0.1)
    return _finish(fig, ax, "answers per episode", title, xlabel=STEP_UPDATES)
