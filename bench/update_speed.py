"""One PPO update on a CPU: the row-by-row float32 update, the default (shared prompts), bf16 autocast, LoRA.

    PYTHONPATH=. .venv/bin/python bench/update_speed.py [--model smollm2-135m-instruct] [--groups 4]
        [--group-size 8] [--prompt 38] [--completion 16] [--repeats 3] [--threads 2] [--lora-rank 16]
        [--no-lora] [--no-bf16] [--baseline-tree DIR] [--json bench/results/update_speed.json]

The workload is one `FSDPPPOActor.ppo_update` (packed forward, backward, gradient clipping, AdamW step) of
SmolLM2-135M-Instruct on one GRPO batch, the same every time: `--groups` random prompts of `--prompt` tokens, the
first `--common-start` of them the same in every prompt (a chat template's system prompt), each with `--group-size`
random completions of `--completion` policy tokens (the defaults are `make demo`'s batch: 4 prompts x 8 samples,
38 prompt tokens of which 27 are the template's, up to 16 new tokens). Every row carries signal (no zero
advantage), so no row is skipped. Rows:
1. `float32, rows whole`: each row runs whole (`actor.share_prompts = False`): the update before prompts were
   shared, the reference the others are compared with;
2. `float32, group prompts once`: each group's prompt runs once, but the prompts' common start once per prompt
   (the default until the common start was shared too);
3. `float32 (default)`: what the kit trains with on a CPU without native bf16: each prompt runs once for its
   group, and the prompts' common start once for all (`packing.share_prompts`);
4. `bf16 autocast`: `dtype="bfloat16"` with `AREAL_LITE_CPU_BF16=1`: float32 weights and AdamW state, forward
   passes under `torch.autocast("cpu", torch.bfloat16)` (forced, so the row exists on any CPU);
5. `LoRA`: `use_lora=True`, rank `--lora-rank` (alpha twice the rank) on every decoder linear layer, float32: only
   the adapter gets gradients and AdamW state (the frozen base still runs forward and passes gradients back);
6. `LoRA + bf16`: the same adapter under the bf16 autocast.
With `--baseline-tree DIR` (a `git worktree` of an older commit), one more row comes first: that tree's own float32
update on the same batch, in a child process (`bench/_update_worker.py`), each row then also compared with it. Issue
30 measured the update at a4b8130, whose update differs from row 1 in more than shared prompts: AdamW ran
tensor by tensor (not fused), the entropies took a second log-softmax, and freed memory went back to the system
(`git worktree add /tmp/a4b8130 a4b8130`, then `--baseline-tree /tmp/a4b8130`).
Printed: the CPU's bf16 support (AVX-512 BF16 or AMX, `utils/device.cpu_native_bf16`), each row's median seconds
per update with its spread (lowest-highest), how many times as fast as row 1 it is, its trainable parameters, and
the largest difference between the bf16 and float32 log-probs of the policy tokens (before any update). The same
figures go to `--json`, with the date, the commit measured (and whether the tree was dirty) and the CPU.

Design decisions
- The rows take turns `--repeats` times after one warm-up update each (the first AdamW step allocates its state,
  and first calls pay one-time kernel set-up), and medians are compared: a shared machine drifts.
- Rows 1 and 2 are one actor, switched between the two layouts, so they differ in nothing else.
- bf16 is forced rather than left to the actor's detector, because the question is what it costs here. Without
  AVX-512 BF16 or AMX, bf16 matmuls are emulated (converted to float32 and back), so expect those rows to be slow:
  that is why the actor trains in float32 on such a CPU unless told otherwise (`--no-bf16` skips them).
- AdamW's learning rate is 1e-7: every step runs the whole update while the weights barely move, so the repeats
  time the same work (the speed of a matmul does not depend on the values anyway).

Figures: the README (the paragraph after the table of `bench/vs_trl.py` runs) has this bench's runs;
`bench/results/update_speed.json` holds the latest run whole. They are kept there only, so that a re-measurement
changes one place.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
from _machine import cpu_model, git_state  # noqa: E402
from _models import bench_model_path  # noqa: E402  (bench/ is on sys.path when a bench script runs)

from areal_lite.api.cli_args import OptimizerConfig, PPOActorConfig  # noqa: E402
from areal_lite.engine.fsdp_engine import CPU_BF16_ENV, FSDPPPOActor  # noqa: E402
from areal_lite.engine.fsdp_utils import packing  # noqa: E402
from areal_lite.utils.device import cpu_native_bf16  # noqa: E402

BEFORE = "float32, rows whole"


def make_batch(
    groups: int, group_size: int, prompt: int, completion: int, vocab: int, common: int = 0, seed: int = 0
) -> dict:
    """A GRPO batch: `groups` random prompts, each beginning with the same `common` tokens (a chat template's
    system prompt), each with `group_size` random completions (no padding). Rewards are uniform in [0, 1), so no
    row's advantage is zero and none is skipped (`FSDPPPOActor.skip_silent_rows`): the update does all its work."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(10, vocab, (common,), generator=g)
    rows = []
    for _ in range(groups):
        p = torch.cat([start, torch.randint(10, vocab, (prompt - common,), generator=g)])
        rows += [torch.cat([p, torch.randint(10, vocab, (completion,), generator=g)]) for _ in range(group_size)]
    ids = torch.stack(rows)
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, prompt:] = 1
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids, dtype=torch.bool),
        "loss_mask": loss_mask,
        "rewards": torch.rand(ids.shape[0], generator=g),
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


def one_update(actor: FSDPPPOActor, batch: dict, share: str) -> float:
    """One timed ppo_update; `share`: "no" (rows whole), "prompts" (each group's prompt once, but not the prompts'
    common start), "all" (the default: the common start once too)."""
    actor.share_prompts = share != "no"
    saved = packing.COMMON_START_MIN_SAVED
    packing.COMMON_START_MIN_SAVED = saved if share == "all" else 1 << 30
    try:
        stats = actor.ppo_update({k: v.clone() for k, v in batch.items()})
    finally:
        packing.COMMON_START_MIN_SAVED = saved
    if stats["skipped"] or stats["silent_rows"]:
        raise RuntimeError("the update was skipped (non-finite gradient) or left rows out: not a full step")
    return stats["update_time"]


class BaselineTree:
    """The float32 update of another source tree (`--baseline-tree`), in a child process (`_update_worker.py`) that
    runs one update each time `update()` asks: the same batch, threads and optimizer settings as the rows here.
    The batch reaches it through a file in a temporary folder of its own, removed by `close()`."""

    def __init__(self, tree: str, batch: dict, path: str, threads: int):
        self.tmp = tempfile.TemporaryDirectory()
        batch_file = os.path.join(self.tmp.name, "batch.pt")
        torch.save(batch, batch_file)
        worker = os.path.join(ROOT, "bench", "_update_worker.py")
        env = dict(os.environ, PYTHONPATH=tree)  # the tree's areal_lite, not ours
        self.proc = subprocess.Popen(
            [sys.executable, worker, batch_file, path, str(threads)],
            cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        ready = self._line()
        if not ready.startswith("ready "):
            raise RuntimeError(f"the baseline worker did not start (said {ready!r}; its errors are above)")
        self.trainable_M = int(ready.split()[1]) / 1e6

    def _line(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the baseline worker exited (code {self.proc.wait()}; its errors are above)")
        return line.strip()

    def update(self) -> float:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return float(self._line())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # end of input ends the worker
            self.proc.wait(timeout=60)
        self.tmp.cleanup()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--groups", type=int, default=4, help="prompts per batch")
    ap.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    ap.add_argument("--prompt", type=int, default=38, help="prompt tokens per row")
    ap.add_argument("--common-start", type=int, default=27, help="leading prompt tokens all groups share (the "
                    "demo's chat template: 27 of its 38)")  # fmt: skip
    ap.add_argument("--completion", type=int, default=16, help="policy tokens per row")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lora-rank", type=int, default=16, help="rank of the LoRA rows")
    ap.add_argument("--no-lora", action="store_true", help="no LoRA rows")
    ap.add_argument("--no-bf16", action="store_true", help="no bf16 rows (where bf16 is emulated they are slow)")
    ap.add_argument("--baseline-tree", default="", help="source tree whose float32 update is one more row (e.g. "
                    "a git worktree of a4b8130, where issue 30 measured the update)")  # fmt: skip
    ap.add_argument(
        "--json", default=os.path.join(ROOT, "bench", "results", "update_speed.json"), help="results file ('' for none)"
    )
    args = ap.parse_args()

    path = bench_model_path(args.model)
    fp32 = build_actor(path, "float32", args.threads)
    actors = {"float32": fp32}
    # (row name, actor, shared prompts): the first row is the update as it was before prompts were shared
    rows = [(BEFORE, "float32", "no"), ("float32, group prompts once", "float32", "prompts")]
    rows.append(("float32 (default)", "float32", "all"))
    if not args.no_bf16:
        actors["bf16"] = build_actor(path, "bfloat16", args.threads)
        rows.append(("bf16 autocast", "bf16", "all"))
    if not args.no_lora:
        r = args.lora_rank
        actors["lora"] = build_actor(path, "float32", args.threads, r)
        rows.append((f"LoRA r{r}", "lora", "all"))
        if not args.no_bf16:
            actors["lora_bf16"] = build_actor(path, "bfloat16", args.threads, r)
            rows.append((f"LoRA r{r} + bf16", "lora_bf16", "all"))
    vocab = fp32.model.config.vocab_size
    batch = make_batch(args.groups, args.group_size, args.prompt, args.completion, vocab, args.common_start)
    logp = fp32.compute_logp(batch)
    lp_diff = None
    if not args.no_bf16:
        lp_diff = float((actors["bf16"].compute_logp(batch) - logp)[batch["loss_mask"].bool()].abs().max())
    batch["logprobs"] = batch["prox_logp"] = logp
    fp32.compute_advantages(batch)

    def trainable_M(actor: FSDPPPOActor) -> float:
        return sum(p.numel() for p in actor.model.parameters() if p.requires_grad) / 1e6

    # name -> (one timed update, trainable parameters in millions)
    runs = {
        name: (lambda a=actors[key], s=share: one_update(a, batch, s), trainable_M(actors[key]))
        for name, key, share in rows
    }
    baseline, baseline_name, baseline_state = None, "", {}
    if args.baseline_tree:
        tree = os.path.abspath(args.baseline_tree)
        baseline_state = {"tree": tree, **git_state(tree)}
        commit = baseline_state["commit"][:7] or tree
        baseline_name = f"float32 at {commit}" + (" (dirty)" if baseline_state["dirty"] else "")
        baseline = BaselineTree(tree, batch, path, args.threads)
        runs = {baseline_name: (baseline.update, baseline.trainable_M), **runs}

    native = cpu_native_bf16() or "none (no AVX-512 BF16, no AMX)"
    n_params = sum(p.numel() for p in fp32.model.parameters()) / 1e6
    B, L = batch["input_ids"].shape
    shared = args.common_start + args.groups * (args.prompt - args.common_start) + B * args.completion
    print(
        f"model {os.path.basename(path)} ({n_params:.1f} M params), {torch.get_num_threads()} threads; "
        f"{args.groups} prompts of {args.prompt} tokens x {args.group_size} samples of {args.completion} tokens: "
        f"{args.common_start} of them common to all; {B * L} tokens per row-by-row pass, {shared} shared; "
        f"CPU {torch.backends.cpu.get_cpu_capability()}, native bf16: {native}"
    )
    for name, (run, _) in runs.items():
        if name != baseline_name:
            run()  # warm-up: AdamW state, oneDNN kernels (the baseline worker warmed up on its own)
    times = {name: [] for name in runs}
    for _ in range(args.repeats):  # interleaved, so background load hits every row alike
        for name, (run, _) in runs.items():
            times[name].append(run())
    if baseline is not None:
        baseline.close()
    med = {name: statistics.median(t) for name, t in times.items()}
    result = {
        "args": vars(args),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        **git_state(ROOT),  # the tree measured (the baseline's own is under "baseline")
        "cpu": cpu_model(),
        "native_bf16": native,
        "rows": {},
    }
    if baseline is not None:
        result["baseline"] = baseline_state
    for name, (_, trainable) in runs.items():
        t = times[name]
        row = {"seconds": t, "median": med[name], "speedup": med[BEFORE] / med[name], "trainable_M": trainable}
        line = f"{name:26s}: median {med[name]:6.2f} s per update ({min(t):.2f}-{max(t):.2f}, {len(t)} runs), "
        line += f"{row['speedup']:.2f}x as fast as '{BEFORE}'"
        if baseline is not None:
            row["speedup_vs_baseline"] = med[baseline_name] / med[name]
            line += f", {row['speedup_vs_baseline']:.2f}x as fast as '{baseline_name}'"
        print(f"{line}, {trainable:.2f} M trainable params")
        result["rows"][name] = row
    if lp_diff is not None:
        print(f"largest |log-prob difference| bf16 vs float32 on the policy tokens: {lp_diff:.2e}")
        result["bf16_logp_max_diff"] = lp_diff
    if args.json:  # '' writes no file
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    for actor in actors.values():
        actor.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
