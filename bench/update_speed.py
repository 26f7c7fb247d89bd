"""One PPO update on a CPU in float32 vs bfloat16 autocast, full or LoRA: seconds per update, and what bf16 changes
in the log-probs.

    PYTHONPATH=. .venv/bin/python bench/update_speed.py [--model smollm2-135m-instruct] [--rows 8] [--tokens 128]
        [--prompt 32] [--repeats 3] [--threads 2] [--lora-rank 16] [--no-lora]

The workload is one `FSDPPPOActor.ppo_update` (packed forward, backward, gradient clipping, AdamW step) of
SmolLM2-135M-Instruct on one batch of `--rows` rows x `--tokens` tokens (random ids, the first `--prompt` tokens of
each row a prompt, the rest policy tokens), the same batch every time. Two actors from the same weights:
1. `float32`: `dtype="float32"`, what the kit trains in on a CPU by default;
2. `bf16 autocast`: `dtype="bfloat16"` with `AREAL_LITE_CPU_BF16=1`, i.e. float32 weights and AdamW state, forward
   passes under `torch.autocast("cpu", torch.bfloat16)` (forced, so the row exists on any CPU);
3. `LoRA`: `use_lora=True`, rank `--lora-rank` (alpha twice the rank) on every decoder linear layer, float32: only
   the adapter gets gradients and AdamW state (the frozen base still runs forward and passes gradients back);
4. `LoRA + bf16`: the same adapter under the bf16 autocast.
Printed: the CPU's bf16 support (AVX-512 BF16 or AMX, `utils/device.cpu_native_bf16`), the median seconds per
update of each with its spread (lowest-highest), each row's time over float32's (below 1: faster), and the largest
difference between the bf16 and float32 actors' log-probs on the batch (`compute_logp`, before any update).

Design decisions
- The two actors take turns `--repeats` times after one warm-up update each (the first AdamW step allocates its
  state, and first calls pay one-time kernel set-up), and medians are compared: a shared machine drifts.
- bf16 is forced rather than left to the actor's detector, because the question is what it costs here. Without
  AVX-512 BF16 or AMX, bf16 matmuls are emulated (converted to float32 and back), so expect the ratio above 1:
  that is why the actor trains in float32 on such a CPU unless told otherwise.
- AdamW's learning rate is 1e-7: every step runs the whole update while the weights barely move, so the repeats
  time the same work (the speed of a matmul does not depend on the values anyway).
- Measured on the 2-core AVX2 machine this was written on, shared with another job (load ~2.8), `--repeats 2`:
  float32 65 s per update (57-73), bf16 autocast 241 s (226-256), 3.7x slower; log-probs differ by 0.04 on
  average, 0.23 at most. The whole run took 17 minutes.
  (Before the LoRA rows existed; they have not been measured here yet.)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
from _models import bench_model_path  # noqa: E402  (bench/ is on sys.path when a bench script runs)

from areal_lite.api.cli_args import OptimizerConfig, PPOActorConfig  # noqa: E402
from areal_lite.engine.fsdp_engine import CPU_BF16_ENV, FSDPPPOActor  # noqa: E402
from areal_lite.utils.device import cpu_native_bf16  # noqa: E402


def make_batch(rows: int, tokens: int, prompt: int, vocab: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    loss_mask = torch.zeros(rows, tokens, dtype=torch.long)
    loss_mask[:, prompt:] = 1
    return {
        "input_ids": torch.randint(10, vocab, (rows, tokens), generator=g),
        "attention_mask": torch.ones(rows, tokens, dtype=torch.bool),
        "loss_mask": loss_mask,
        "rewards": torch.randint(0, 2, (rows,), generator=g).float(),
    }


def build_actor(path: str, dtype: str, threads: int, lora_rank: int = 0) -> FSDPPPOActor:
    opt = OptimizerConfig(type="adam", lr=1e-7)
    lora = dict(use_lora=True, lora_rank=lora_rank, lora_alpha=2 * lora_rank) if lora_rank else {}
    cfg = PPOActorConfig(path=path, dtype=dtype, device="cpu", threads=threads, optimizer=opt, **lora)
    if dtype != "bfloat16":
        return FSDPPPOActor(cfg).initialize()
    saved = os.environ.get(CPU_BF16_ENV)
    os.environ[CPU_BF16_ENV] = "1"  # force the autocast path, whatever this CPU has
    try:
        return FSDPPPOActor(cfg).initialize()
    finally:
        if saved is None:
            os.environ.pop(CPU_BF16_ENV)
        else:
            os.environ[CPU_BF16_ENV] = saved


def one_update(actor: FSDPPPOActor, batch: dict) -> float:
    stats = actor.ppo_update({k: v.clone() for k, v in batch.items()})
    if stats["skipped"]:
        raise RuntimeError("the update was skipped (non-finite gradient): the timing would not be a full step")
    return stats["update_time"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128, help="tokens per row (no padding)")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per row (the rest are policy tokens)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lora-rank", type=int, default=16, help="rank of the LoRA rows")
    ap.add_argument("--no-lora", action="store_true", help="only the float32 and bf16 rows")
    args = ap.parse_args()

    path = bench_model_path(args.model)
    actors = {"float32": build_actor(path, "float32", args.threads)}
    actors["bf16 autocast"] = build_actor(path, "bfloat16", args.threads)
    if not args.no_lora:
        actors[f"LoRA r{args.lora_rank}"] = build_actor(path, "float32", args.threads, args.lora_rank)
        actors[f"LoRA r{args.lora_rank} bf16"] = build_actor(path, "bfloat16", args.threads, args.lora_rank)
    fp32 = actors["float32"]
    batch = make_batch(args.rows, args.tokens, args.prompt, fp32.model.config.vocab_size)
    logp = {name: actor.compute_logp(batch) for name, actor in actors.items()}
    lp_diff = float((logp["bf16 autocast"] - logp["float32"]).abs().max())
    batch["logprobs"] = batch["prox_logp"] = logp["float32"]
    fp32.compute_advantages(batch)

    native = cpu_native_bf16() or "none (no AVX-512 BF16, no AMX)"
    n_params = sum(p.numel() for p in fp32.model.parameters()) / 1e6
    print(
        f"model {os.path.basename(path)} ({n_params:.1f} M params), {torch.get_num_threads()} threads; "
        f"{args.rows} rows x {args.tokens} tokens ({args.rows * (args.tokens - args.prompt)} policy tokens); "
        f"CPU {torch.backends.cpu.get_cpu_capability()}, native bf16: {native}"
    )
    for actor in actors.values():
        one_update(actor, batch)  # warm-up: AdamW state, oneDNN kernels
    times = {name: [] for name in actors}
    for _ in range(args.repeats):  # interleaved, so background load hits both alike
        for name, actor in actors.items():
            times[name].append(one_update(actor, batch))
    med = {name: statistics.median(t) for name, t in times.items()}
    for name, t in times.items():
        trainable = sum(p.numel() for p in actors[name].model.parameters() if p.requires_grad) / 1e6
        print(
            f"{name:18s}: median {med[name]:.2f} s per update ({min(t):.2f}-{max(t):.2f}, {len(t)} runs), "
            f"{med[name] / med['float32']:.2f}x float32's time, {trainable:.2f} M trainable params"
        )
    print(f"largest |log-prob difference| bf16 vs float32 on the batch: {lp_diff:.2e}")
    for actor in actors.values():
        actor.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
