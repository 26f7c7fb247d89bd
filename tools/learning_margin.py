"""The learning test's margin over seeds: runs `tests/test_train.py`'s learning run once per seed and prints, for
each, the rewards by step and (last-3 minus first-3 mean reward), the quantity the test asserts > 0.4.

Why: a learning test is only as reliable as its worst seed. Sampling is reproducible, so one seed gives one result
on one machine; another machine's rounding can send the same seed down another path, so the bar needs a margin
over many seeds. Run this after changing the task, the trainer or the server's sampling, and update the figures in
the test module's docstring.

Usage: python tools/learning_margin.py [--seeds 1-60] [--steps 16] [--lr 6e-2]   (a short training run a seed)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import test_train  # noqa: E402  (the test's own config and workflow: the margin is the test's, not a copy's)

from areal_lite.kit.trainer.train import train  # noqa: E402
from areal_lite.utils.model_store import build_tiny_model, load_tokenizer  # noqa: E402


def seed_range(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="1-60", help="a seed or a range, e.g. 1-60")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--lr", type=float, default=None, help="default: the test's")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="learning-margin-"))
    path = build_tiny_model(str(root / "tiny"), seed=0)  # the test's model (conftest builds it the same way)
    tok = load_tokenizer(path)
    margins = []
    for seed in seed_range(args.seeds):
        kw = {} if args.lr is None else {"lr": args.lr}
        cfg = test_train.make_config(root / f"seed{seed}", path, steps=args.steps, **kw)
        cfg.seed = seed
        stats = train(cfg, workflow=test_train.token_workflow(tok, cfg), progress=False)
        rewards = [round(s["reward"], 3) for s in stats]
        margin = sum(rewards[-3:]) / 3 - sum(rewards[:3]) / 3
        margins.append(margin)
        print(json.dumps({"seed": seed, "margin": round(margin, 3), "rewards": rewards}), flush=True)
    passed = sum(m > 0.4 for m in margins)
    print(f"{passed} of {len(margins)} seeds passed; margin min {min(margins):.3f}, max {max(margins):.3f}")


if __name__ == "__main__":
    main()
