"""One actor of another source tree, timing `ppo_update` on request: `bench/update_speed.py --baseline-tree`.

    PYTHONPATH=<tree> python bench/_update_worker.py BATCH_FILE MODEL_PATH THREADS

Run with the other tree first on the path, so `areal_lite` is that tree's. It builds a float32 actor the way
`update_speed.build_actor` does (AdamW, lr 1e-7, the given threads), loads the batch `torch.save`d in BATCH_FILE,
runs one warm-up update and prints `ready <trainable params>`; then for every `go` line on stdin it runs one
`ppo_update` on a fresh copy of the batch and prints its `update_time` in seconds. Any other line ends it. The
parent takes turns with its own rows, so only one of the two processes computes at a time.

Two layouts are known: the package as AReaL lays it out (`api/cli_args.py`, `engine/fsdp_engine.py`), and a flat
one (`config.py`, `actor.py`: `PPOActor`).
"""

from __future__ import annotations

import sys

import torch


def build(path: str, threads: int):
    try:
        from areal_lite.api.cli_args import OptimizerConfig, PPOActorConfig
        from areal_lite.engine.fsdp_engine import FSDPPPOActor as Actor
    except ImportError:  # the flat layout, before the package took AReaL's
        from areal_lite.actor import PPOActor as Actor
        from areal_lite.config import OptimizerConfig, PPOActorConfig
    opt = OptimizerConfig(type="adam", lr=1e-7)
    return Actor(PPOActorConfig(path=path, dtype="float32", device="cpu", threads=threads, optimizer=opt)).initialize()


def main() -> int:
    batch_file, path, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
    actor = build(path, threads)
    batch = torch.load(batch_file)

    def update() -> float:
        stats = actor.ppo_update({k: v.clone() for k, v in batch.items()})
        if stats.get("skipped"):
            raise RuntimeError("the baseline's update was skipped (non-finite gradient): not a full step")
        return stats["update_time"]

    update()  # warm-up, as the parent's rows: AdamW state, oneDNN kernels
    trainable = sum(p.numel() for p in actor.model.parameters() if p.requires_grad)
    print(f"ready {trainable}", flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        print(f"{update():.6f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
