"""Plots render to real PNG files from lists of dicts and from JSONL; bad input gives clear errors."""

from __future__ import annotations

import json

import pytest

from areal_lite.kit.notebook.plot import (
    load_stats,
    plot_response_length,
    plot_rewards,
    plot_sync_vs_async,
    plot_time_breakdown,
    save_png,
    smooth,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _close_figures():
    """Jupyter's inline backend closes a cell's figures once it has shown them; each test does so when it ends."""
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


def fake_stats(n=8, async_=False):
    rows = []
    for i in range(n):
        g, u = 1.0 + 0.1 * i, 0.5
        rows.append(
            {
                "step": i,
                "reward": i / n,
                "response_length": 20 - i,
                "time/generate": g,
                "time/logp": 0.1,
                "time/update": u,
                "time/weight_sync": 0.05,
                "time/step": (max(g, u) if async_ else g + u) + 0.15,
                **({"eval_accuracy": 0.3 + i / 20} if i % 4 == 0 else {}),
            }
        )
    return rows


def is_png(path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(8) == PNG_MAGIC


def test_every_plot_renders_png(tmp_path):
    rows = fake_stats()
    for name, fig in [
        ("rewards", plot_rewards(rows)),
        ("length", plot_response_length(rows)),
        ("time", plot_time_breakdown(rows)),
        ("sva", plot_sync_vs_async(rows, fake_stats(async_=True))),
    ]:
        path = save_png(fig, tmp_path / "sub" / f"{name}.png")
        assert is_png(path) and (tmp_path / "sub" / f"{name}.png").stat().st_size > 2000


def test_jsonl_input_and_existing_axes(tmp_path):
    import matplotlib.pyplot as plt

    path = tmp_path / "stats.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in fake_stats()) + "\n\n")
    assert len(load_stats(path)) == 8
    fig, axes = plt.subplots(1, 2)
    assert plot_rewards(str(path), ax=axes[0]) is fig
    assert plot_time_breakdown(path, ax=axes[1]) is fig
    assert len(axes[0].lines) == 3  # points, smoothed, eval accuracy
    save_png(fig, tmp_path / "both.png")
    assert is_png(tmp_path / "both.png")


def test_explicit_evals_are_drawn_where_given():
    fig = plot_rewards(
        [{"reward": 0.1}, {"reward": 0.5}], evals=[(0, 0.2), (2, 0.7)], eval_label="held-out, sampled", eval_n=25
    )
    line = fig.axes[0].lines[-1]
    assert list(line.get_xdata()) == [0.0, 2.0] and list(line.get_ydata()) == [0.2, 0.7]
    assert line.get_label() == "held-out, sampled, n=25"
    assert line.get_linestyle() == "None"  # two measurements are markers, not a trend line
    assert [t.get_text() for t in fig.axes[0].texts] == ["0.20", "0.70"]
    assert fig.axes[0].get_ylabel() == "training reward"
    # a marker at x = 2 is the model after two updates: the axis says so (without markers it is just "step")
    assert fig.axes[0].get_xlabel() == "step (updates done)"
    assert plot_rewards([{"reward": 0.1}, {"reward": 0.5}]).axes[0].get_xlabel() == "step"


def test_evals_of_another_quantity_get_their_own_axis():
    fig = plot_rewards(
        [{"reward": -1.5}, {"reward": 0.5}],
        evals=[(0, 0.6), (2, 0.9)],
        eval_label="accuracy",
        eval_axis="accuracy",
        ylabel="return G_0",
    )
    left, right = fig.axes
    assert left.get_ylabel() == "return G_0" and right.get_ylabel() == "accuracy"
    assert left.get_xlabel() == "step (updates done)"
    assert list(right.lines[0].get_ydata()) == [0.6, 0.9] and right.get_ylim() == (-0.05, 1.1)
    assert "accuracy" in [t.get_text() for t in left.get_legend().get_texts()]


def test_clear_errors(tmp_path):
    with pytest.raises(KeyError, match="no reward.*keys present: \\['loss'\\]"):
        plot_rewards([{"loss": 1.0}])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"reward": 1}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_stats(bad)
    with pytest.raises(TypeError, match="stats\\[0\\]"):
        plot_rewards([1.0])


def test_smooth_is_bias_corrected():
    assert smooth([1.0, 1.0, 1.0], 0.9) == pytest.approx([1.0, 1.0, 1.0])
    assert smooth([0.0, 1.0], 0.0) == [0.0, 1.0]
    with pytest.raises(ValueError):
        smooth([1.0], 1.0)


def test_plot_turns_draws_mean_turns_and_bounds(tmp_path):
    from areal_lite.kit.notebook.plot import plot_turns

    rows = [{"step": i, "turns": 2.0 - i / 4} for i in range(4)]
    fig = plot_turns(rows, max_turns=3)
    ax = fig.axes[0]
    assert list(ax.lines[0].get_ydata()) == [2.0, 1.75, 1.5, 1.25]
    assert sorted(line.get_ydata()[0] for line in ax.lines[2:]) == [1, 3]  # the two dotted bounds
    assert is_png(save_png(fig, tmp_path / "turns.png"))
    labels = [t.get_text() for t in plot_turns(rows, n=16).axes[0].get_legend().get_texts()]
    assert labels[0] == "turns (per step, n=16)"  # an estimate is read with its n
    with pytest.raises(KeyError, match="no turn count"):
        plot_turns([{"reward": 1.0}])


def test_sync_vs_async_legend_is_the_mean_after_warmup_over_runs():
    def run(step_times):
        return [{"reward": 0.1 * i, "time/step": t} for i, t in enumerate(step_times)]

    fig = plot_sync_vs_async([run([9.0, 4.0, 6.0]), run([9.0, 6.0, 8.0])], run([9.0, 3.0, 3.0]))
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == ["sync: mean 6.0 s (steps 1+, 2 runs)", "async: mean 3.0 s (steps 1+)"]


def test_plots_read_as_estimates_with_their_n_on_whole_steps():
    """Steps are whole numbers, every curve says how many episodes a point averages, a phase that never took time is
    not in the legend, the first phase can be named for what it is, and lengths and [0, 1] rewards start at 0."""
    rows = [dict(r, **{"time/logp": 0.0}) for r in fake_stats(3)]
    fig = plot_rewards(rows, train_n=16, train_label="return G_0")
    ax = fig.axes[0]
    assert all(float(t).is_integer() for t in ax.get_xticks())
    assert "return G_0 (per step, n=16)" in [line.get_label() for line in ax.get_lines()]
    assert ax.get_ylim()[0] < 0 < 1 < ax.get_ylim()[1]
    fig = plot_time_breakdown(rows, generate_label="wait for rollouts")
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert "logp" not in labels and "wait for rollouts" in labels and "generate" not in labels
    # a recompute of microseconds (one minibatch: nothing recomputed) draws no bar, so it is not in the legend either
    tiny = [dict(r, **{"time/logp": 8e-5}) for r in rows]
    assert "logp" not in plot_time_breakdown(tiny).axes[0].get_legend_handles_labels()[1]
    assert (
        "logp"
        in plot_time_breakdown([dict(r, **{"time/logp": 0.5}) for r in rows]).axes[0].get_legend_handles_labels()[1]
    )
    assert all(float(t).is_integer() for t in fig.axes[0].get_xticks())
    fig = plot_response_length(rows, n=8)
    assert fig.axes[0].get_ylim()[0] == 0
    points, line = fig.axes[0].get_lines()[:2]
    assert points.get_label() == "generated tokens (per step, n=8)"
    assert line.get_label() == "generated tokens (moving average, weight 0.6)"
    assert points.get_zorder() > line.get_zorder()  # the line starts on the first point: drawn under it
    fig = plot_sync_vs_async(fake_stats(4), fake_stats(4, async_=True), show_reward=False)
    assert len(fig.axes) == 1
