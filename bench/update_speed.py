"""One PPO update on a CPU: the row-by-row float32 update, the default (shared prompts), bf16 autocast, LoRA.

    PYTHONPATH=. .venv/bin/python bench/update_speed.py [--groups 4] [--group-size 8] [--repeats 3] [--no-lora]
        [--no-bf16] [--baseline-tree DIR] [--json bench/results/update_speed.json]   (`--help`: every option)

The workload is one `FSDPPPOActor.ppo_update` (packed forward, backward, clipping, AdamW step) of SmolLM2-135M on
one fixed GRPO batch, by default `make demo`'s: 4 random prompts of 38 tokens (27 the template's, shared) x 8 random
completions of 16 tokens, every row with signal. The rows (`build_rows`): rows run whole, each group's prompt once,
the default (the common start once as well), bf16 autocast, LoRA, LoRA + bf16; `--baseline-tree` adds an older
tree's update (`bench/_update_worker.py`). Printed and written to `--json`: seconds per update (median, spread),
the speed-up over rows run whole, trainable parameters, the bf16/float32 log-prob difference, and for the default
and bf16 rows the fraction of the matmul limit (`bench/_limit.py`). docs/benchmarks.md says more.

Design decisions
- The rows take turns `--repeats` times after one warm-up update each (the first AdamW step allocates its state),
  and medians are compared: a shared machine drifts. Rows 1 and 2 are one actor switched between two layouts.
- bf16 is forced (`AREAL_LITE_CPU_BF16=1`), not left to the actor's detector: the question is what it costs here.
  Without AVX-512 BF16 or AMX it is emulated and slow, which is why the actor trains in float32 on such a CPU.
- AdamW's learning rate is 1e-7: every step runs the whole update while the weights barely move.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
from _limit import measure_peak_gflops, update_flops  # noqa: E402
from _machine import git_state, write_results  # noqa: E402
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


def parse_args() -> argparse.Namespace:
    """The command line (the module docstring is its help)."""
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
                    "a git worktree of an earlier commit)")  # fmt: skip
    ap.add_argument(
        "--json", default=os.path.join(ROOT, "bench", "results", "update_speed.json"), help="results file ('' for none)"
    )
    return ap.parse_args()


def build_rows(args: argparse.Namespace, path: str) -> tuple[dict[str, FSDPPPOActor], list[tuple[str, str, str]]]:
    """The actors the rows need (by key, "float32" always) and the rows: (row name, actor key, shared prompts).

    `no`: each row runs whole (`actor.share_prompts = False`), the reference; `prompts`: each group's prompt once, the
    common start once per prompt (`packing.COMMON_START_MIN_SAVED` out of reach); `all`: the kit's default, the
    common start once for all. bf16 rows: float32 weights and AdamW state, forward under `torch.autocast` with
    attention in float32 (`packing.packed_sdpa_attention`). LoRA rows: rank `--lora-rank`, alpha twice the rank, on
    every decoder linear layer (the frozen base still runs forward and passes gradients back)."""
    actors = {"float32": build_actor(path, "float32", args.threads)}
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
    return actors, rows


def prepare_batch(args: argparse.Namespace, actors: dict[str, FSDPPPOActor]) -> tuple[dict, float | None]:
    """The batch every row updates on, with float32 log-probs and advantages; the largest bf16 vs float32 log-prob
    difference on its policy tokens (None without the bf16 rows)."""
    fp32 = actors["float32"]
    vocab = fp32.model.config.vocab_size
    batch = make_batch(args.groups, args.group_size, args.prompt, args.completion, vocab, args.common_start)
    logp = fp32.compute_logp(batch)
    lp_diff = None
    if not args.no_bf16:
        lp_diff = float((actors["bf16"].compute_logp(batch) - logp)[batch["loss_mask"].bool()].abs().max())
    batch["logprobs"] = batch["prox_logp"] = logp
    fp32.compute_advantages(batch)
    return batch, lp_diff


def trainable_M(actor: FSDPPPOActor) -> float:
    """The actor's trainable parameters, in millions."""
    return sum(p.numel() for p in actor.model.parameters() if p.requires_grad) / 1e6


def start_baseline(args: argparse.Namespace, batch: dict, path: str) -> tuple[BaselineTree | None, str, dict]:
    """`--baseline-tree`'s worker, its row name and its tree's git state (None, "", {} without one)."""
    if not args.baseline_tree:
        return None, "", {}
    tree = os.path.abspath(args.baseline_tree)
    state = {"tree": tree, **git_state(tree)}
    commit = state["commit"][:7] or tree
    name = f"float32 at {commit}" + (" (dirty)" if state["dirty"] else "")
    return BaselineTree(tree, batch, path, args.threads), name, state


def print_workload(args: argparse.Namespace, path: str, fp32: FSDPPPOActor, batch: dict) -> str:
    """Print the model, the batch's shape and the CPU; return the CPU's native bf16 support as printed."""
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
    return native


def time_rows(
    runs: dict, repeats: int, baseline_name: str, limit_dtypes: list, threads: int
) -> tuple[dict[str, list[float]], dict[torch.dtype, list[float]]]:
    """One warm-up update per row, then `repeats` turns of one timed update per row. After each turn, the matmul limit
    of each of `limit_dtypes` (`_limit.measure_peak_gflops` at `threads`, the updates'): measured between the updates,
    it sees the same drift of a shared machine. Returns ({row name: seconds}, {dtype: GFLOP/s})."""
    for name, (run, _) in runs.items():
        if name != baseline_name:
            run()  # warm-up: AdamW state, oneDNN kernels (the baseline worker warmed up on its own)
    times = {name: [] for name in runs}
    peaks = {dtype: [] for dtype in limit_dtypes}
    for _ in range(repeats):  # interleaved, so background load hits every row alike
        for name, (run, _) in runs.items():
            times[name].append(run())
        for dtype in limit_dtypes:
            peaks[dtype].append(measure_peak_gflops(threads, dtype, seconds=1.0))
    return times, peaks


def report_rows(
    runs: dict, times: dict, native: str, lp_diff: float | None, baseline_name: str, baseline_state: dict
) -> dict:
    """Print each row's figures (and the bf16 log-prob difference); return the figures `--json` gets (beside the
    machine and the tree measured: `_machine.write_results`; the baseline tree's own state is under "baseline")."""
    med = {name: statistics.median(t) for name, t in times.items()}
    result = {"native_bf16": native, "rows": {}}
    if baseline_name:
        result["baseline"] = baseline_state
    for name, (_, trainable) in runs.items():
        t = times[name]
        row = {"seconds": t, "median": med[name], "speedup": med[BEFORE] / med[name], "trainable_M": trainable}
        line = f"{name:26s}: median {med[name]:6.2f} s per update ({min(t):.2f}-{max(t):.2f}, {len(t)} runs), "
        line += f"{row['speedup']:.2f}x as fast as '{BEFORE}'"
        if baseline_name:
            row["speedup_vs_baseline"] = med[baseline_name] / med[name]
            line += f", {row['speedup_vs_baseline']:.2f}x as fast as '{baseline_name}'"
        print(f"{line}, {trainable:.2f} M trainable params")
        result["rows"][name] = row
    if lp_diff is not None:
        print(f"largest |log-prob difference| bf16 vs float32 on the policy tokens: {lp_diff:.2e}")
        result["bf16_logp_max_diff"] = lp_diff
    return result


# Rows held against the limit: their matmuls' dtype, whose `torch.mm` rate is the limit.
LIMIT_ROWS = {"float32 (default)": torch.float32, "bf16 autocast": torch.bfloat16}


def limit_rows(args: argparse.Namespace, config, result: dict, peaks: dict) -> None:
    """Add to `result` (and print) how close the default and bf16 rows come to the CPU's matmul limit: the update's
    counted FLOPs (`_limit.update_flops`, the least the update needs) over the row's median time, as a fraction of
    a large `torch.mm`'s GFLOP/s in the row's dtype (`peaks`: `time_rows`'s measurements, their median)."""
    flops = update_flops(config, args.groups, args.group_size, args.prompt, args.completion, args.common_start)
    result["update_flops"] = flops
    for name, dtype in LIMIT_ROWS.items():
        row = result["rows"].get(name)
        if row is None:
            continue
        peak = statistics.median(peaks[dtype])
        achieved = flops["total"] / row["median"] / 1e9
        row["limit"] = {"peak_gflops": peak, "peak_runs": peaks[dtype], "gflops": achieved, "fraction": achieved / peak}
        kind = str(dtype).removeprefix("torch.")
        print(
            f"{name:26s}: {flops['total'] / 1e9:.0f} GFLOP of matmuls ({flops['positions']} positions, "
            f"{flops['lm_head_positions']} LM-head rows, backward = 2 forwards) in {row['median']:.2f} s = "
            f"{achieved:.0f} GFLOP/s, {achieved / peak:.0%} of a large {kind} torch.mm ({peak:.0f} GFLOP/s)"
        )


def main() -> int:
    args = parse_args()
    path = bench_model_path(args.model)
    actors, rows = build_rows(args, path)
    batch, lp_diff = prepare_batch(args, actors)
    # name -> (one timed update, trainable parameters in millions)
    runs = {
        name: (lambda a=actors[key], s=share: one_update(a, batch, s), trainable_M(actors[key]))
        for name, key, share in rows
    }
    baseline, baseline_name, baseline_state = start_baseline(args, batch, path)
    if baseline is not None:
        runs = {baseline_name: (baseline.update, baseline.trainable_M), **runs}
    native = print_workload(args, path, actors["float32"], batch)
    limit_dtypes = [dtype for name, dtype in LIMIT_ROWS.items() if name in runs]
    times, peaks = time_rows(runs, args.repeats, baseline_name, limit_dtypes, args.threads)
    if baseline is not None:
        baseline.close()
    result = report_rows(runs, times, native, lp_diff, baseline_name, baseline_state)
    limit_rows(args, actors["float32"].model.config, result, peaks)
    write_results(args.json, "update_speed", args, ROOT, **result)  # '' writes no file
    for actor in actors.values():
        actor.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
