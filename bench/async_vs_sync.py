"""Synchronous vs asynchronous GRPO: step time, the ideal overlap, and how much of it the async loop achieves.

    .venv/bin/python bench/async_vs_sync.py [--model tiny|smollm2-135m-instruct|PATH] [--steps 6] [--runs 3]
        [--max-new-tokens 48] [--eta 1] [--threads 1]

The same model, data, workflow, batch and step count run through `kit.trainer.train.train`, `--runs` times per
mode, interleaved (sync, async, sync, ...): synchronous (`rollout_batch`, eta = 0) and asynchronous
(`prepare_batch`, `--eta`). Server and trainer each get `--threads` torch threads (1 + 1 on a 2-core machine).
Equal work: every response is exactly `--max-new-tokens` long (`min_new_tokens` = `max_new_tokens`), prompts come
in the same order (same seed), and the first step of each run is a warm-up, left out.
`kit.notebook.overlap.compare_runs` turns the runs into the report: g = generation and t = training (logp + update +
weight sync) per step from the synchronous runs, the ideal (g + t) / max(g, t), achieved = sync step / async step
paired run by run, each as mean (lowest-highest run); achieved may exceed the ideal only within that noise.
The workflow samples a group per prompt and scores the fraction of output tokens in a fixed id range (a task the
random model learns; no reward worker processes, so the two server/trainer processes are all that compete for the
cores).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from _models import bench_model_path  # noqa: E402  (bench/ is on sys.path when a bench script runs)

from areal_lite.api.cli_args import (  # noqa: E402
    DatasetConfig,
    EmbeddedServerConfig,
    GenerationHyperparameters,
    InferenceEngineConfig,
    NormConfig,
    OptimizerConfig,
    PPOActorConfig,
)
from areal_lite.kit.notebook.overlap import compare_runs  # noqa: E402
from areal_lite.kit.trainer.train import TrainConfig, train  # noqa: E402
from areal_lite.workflow.grouped import GroupedWorkflow  # noqa: E402
from areal_lite.workflow.token_range import TokenRangeWorkflow  # noqa: E402


def run(path: str, args, eta: int, async_training: bool, root: str, index: int) -> list[dict]:
    from areal_lite.utils.model_store import load_tokenizer

    G = args.group_size
    n = args.max_new_tokens
    g = GenerationHyperparameters(n_samples=G, max_new_tokens=n, min_new_tokens=n, temperature=1.0)
    config = TrainConfig(
        experiment_name="bench-async",
        trial_name=f"{'async' if async_training else 'sync'}-eta{eta}-run{index}",
        fileroot=root,
        total_train_steps=args.steps,
        tokenizer_path=path,
        profile="cpu",
        train_dataset=DatasetConfig(type="arith", batch_size=args.batch_size, seed=0),
        gconfig=g,
        rollout=InferenceEngineConfig(
            consumer_batch_size=args.batch_size,
            max_head_offpolicyness=eta,
            max_concurrent_rollouts=args.batch_size * (eta + 1),
        ),
        actor=PPOActorConfig(
            path=path,
            threads=args.threads,
            group_size=G,
            optimizer=OptimizerConfig(lr=args.lr),
            reward_norm=NormConfig(mean_level="group", std_level="group", group_size=G),
        ),
        embedded=EmbeddedServerConfig(model_path=path, threads=args.threads),
        backend="embedded",
        async_training=async_training,
    )
    tok = load_tokenizer(path)
    workflow = GroupedWorkflow(TokenRangeWorkflow(tok, g.new(n_samples=1)), group_size=G)
    return train(config, workflow=workflow, progress=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--runs", type=int, default=3, help="runs per mode (at least 3 for a spread worth reading)")
    ap.add_argument("--batch-size", type=int, default=4, help="prompts per step")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--eta", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args()
    path = bench_model_path(args.model)
    root = tempfile.mkdtemp(prefix="areal-lite-bench-async-")
    print(
        f"model {os.path.basename(path)}, {args.batch_size} prompts x {args.group_size} samples x exactly "
        f"{args.max_new_tokens} tokens, {args.steps} steps (first is warm-up), eta={args.eta}, "
        f"{args.threads} thread(s) per process"
    )
    runs = {"sync": [], "async": []}
    for i in range(args.runs):
        runs["sync"].append(run(path, args, 0, False, root, i))
        runs["async"].append(run(path, args, args.eta, True, root, i))
    report = compare_runs(runs["sync"], runs["async"])
    print("\n".join(report.lines()))
    stale = max(r["staleness_max"] for rows in runs["async"] for r in rows)
    print(f"max staleness over the async runs: {stale:.0f} (bound eta = {args.eta})")
    return 0 if report.within_ideal and stale <= args.eta else 1


if __name__ == "__main__":
    sys.exit(main())
