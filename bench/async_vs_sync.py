"""Synchronous vs asynchronous GRPO: step time, the ideal overlap, and how much of it the async loop achieves.

    .venv/bin/python bench/async_vs_sync.py [--model tiny|smollm2-135m-instruct|PATH] [--steps 8]
        [--max-new-tokens 48] [--etas 1 2] [--threads 1]

The same model, data, workflow, batch and step count run through `areal_lite.kit.train.train` three (or more) times,
one after the other: synchronous (`rollout_batch`, eta = 0), then asynchronous (`prepare_batch`) with each eta.
Server and trainer each get `--threads` torch threads (1 + 1 on a 2-core machine) in every mode.
From the synchronous run's phase times, g = generation and t = training (logp + update + weight sync) per step:
the ideal overlap is (g + t) / max(g, t) (two stages in a pipeline can at best hide the shorter one). Achieved =
sync step time / async step time; "fraction of ideal" = achieved / ideal (target >= 80%). The first step of each
run is a warm-up and is left out.
The workflow samples a group per prompt and scores the fraction of output tokens in a fixed id range (a task the
random model learns; no reward worker processes, so the two server/trainer processes are all that compete for the
cores). A random tiny model rarely emits EOS, so every response is `--max-new-tokens` long and steps are comparable.
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
from areal_lite.kit.train import TrainConfig, train  # noqa: E402
from areal_lite.workflow.grouped import GroupedWorkflow  # noqa: E402
from areal_lite.workflow.token_range import TokenRangeWorkflow  # noqa: E402


def run(path: str, args, eta: int, async_training: bool, root: str) -> list[dict]:
    from areal_lite.utils.model_store import load_tokenizer

    G = args.group_size
    g = GenerationHyperparameters(n_samples=G, max_new_tokens=args.max_new_tokens, temperature=1.0)
    config = TrainConfig(
        experiment_name="bench-async",
        trial_name=f"{'async' if async_training else 'sync'}-eta{eta}",
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


def mean(xs):
    xs = list(xs)
    return sum(xs) / max(1, len(xs))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=4, help="prompts per step")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--etas", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args()
    path = bench_model_path(args.model)
    root = tempfile.mkdtemp(prefix="areal-lite-bench-async-")
    print(
        f"model {os.path.basename(path)}, {args.batch_size} prompts x {args.group_size} samples x "
        f"{args.max_new_tokens} tokens, {args.steps} steps (first is warm-up), {args.threads} thread(s) per process"
    )

    sync = run(path, args, 0, False, root)[1:]
    g = mean(s["time/generate"] for s in sync)
    t = mean(s["time/logp"] + s["time/update"] + s["time/weight_sync"] for s in sync)
    t_sync = mean(s["time/step"] for s in sync)
    ideal = (g + t) / max(g, t)
    print(
        f"sync       : step {t_sync:6.2f} s   (generate g = {g:.2f} s, train t = {t:.2f} s: logp "
        f"{mean(s['time/logp'] for s in sync):.2f} + update {mean(s['time/update'] for s in sync):.2f} + "
        f"sync {mean(s['time/weight_sync'] for s in sync):.2f}); reward {sync[0]['reward']:.2f} -> "
        f"{sync[-1]['reward']:.2f}"
    )
    print(f"ideal overlap (g + t) / max(g, t) = {ideal:.2f}x")
    ok = True
    for eta in args.etas:
        stats = run(path, args, eta, True, root)[1:]
        t_async = mean(s["time/step"] for s in stats)
        achieved = t_sync / t_async
        frac = achieved / ideal
        ok &= frac >= 0.8
        print(
            f"async eta={eta}: step {t_async:6.2f} s   speed-up {achieved:.2f}x = {frac:.0%} of ideal "
            f"(waiting for data {mean(s['time/generate'] for s in stats):.2f} + logp "
            f"{mean(s['time/logp'] for s in stats):.2f} + update {mean(s['time/update'] for s in stats):.2f} + "
            f"sync {mean(s['time/weight_sync'] for s in stats):.2f}; max staleness "
            f"{max(s['staleness_max'] for s in stats):.0f}); reward {stats[0]['reward']:.2f} -> "
            f"{stats[-1]['reward']:.2f}"
        )
    print(f"target: async >= 80% of the ideal overlap: {'PASS' if ok else 'BELOW TARGET'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
