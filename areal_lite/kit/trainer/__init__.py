"""The training side of the kit: the GRPO loop as one script, its run folders, and the demo.

- `train`: the loop (`python -m areal_lite.kit.trainer.train --config FILE [key=value ...]`): rollouts, advantages,
  PPO update, weight sync, evaluation, checkpoints and `--resume`, `stats.jsonl`;
- `rundir`: a run's folder, whose run it holds and whether a start continues it;
- `demo`: `make demo` (`python -m areal_lite.kit.trainer.demo`), GRPO on a real chat model on a CPU in minutes.
"""
