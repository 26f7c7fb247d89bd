"""Packed vs padded micro-batches for the PPO forward + backward, on a ragged batch; and logits everywhere vs only
where the loss needs them.

    .venv/bin/python bench/packing.py [--model tiny|smollm2-135m-instruct|PATH] [--rows 32] [--repeats 3]
        [--threads 2] [--budget 2048]

Same rows, same model, same loss (sum of next-token log-probs on the response tokens), one after the other:
1. `padded`: rows in dataset order, `--rows-per-mb` rows per micro-batch, each padded to its longest row, with an
   attention mask (what a trainer without packing does);
2. `packed`: `areal_lite.engine.fsdp_engine`'s own path: rows grouped first-fit-decreasing under a token budget,
   unpadded and concatenated into one row per micro-batch with restarting position ids (block-diagonal causal
   attention);
3. `policy`: `packed`, but the LM head runs only at positions that predict a response token (what the actor's
   update does): prompts are most of the tokens, and the head over the vocabulary is a large share of a small model
   (SmolLM2: 28M of 135M weights). Printed as a second ratio, policy / packed.
All process exactly the same number of real tokens; tokens/s counts real tokens only. Lengths are ragged the way
RL batches are: a prompt of 20-60 tokens plus a response whose length is log-normal (most short, a few hit the
cap). Printed: tokens/s of each, the padding fraction of the padded run, and the ratio (target >= 1.5x).
The default model is a 4-layer, 256-wide random Qwen2 with the 4k vocabulary (built offline in a temp folder).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
from _models import bench_model_path  # noqa: E402  (bench/ is on sys.path when a bench script runs)

from areal_lite.api.cli_args import MicroBatchSpec, PPOActorConfig  # noqa: E402
from areal_lite.engine.fsdp_engine import FSDPPPOActor  # noqa: E402
from areal_lite.engine.fsdp_utils.packing import pack_rows, split_into_microbatches  # noqa: E402
from areal_lite.utils.functional import next_token_logp  # noqa: E402


def ragged_batch(rows: int, vocab: int, max_len: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    lengths = []
    for _ in range(rows):
        prompt = int(torch.randint(20, 61, (1,), generator=g))
        resp = int(min(max_len - prompt, math.exp(4.0 + 1.0 * float(torch.randn(1, generator=g)))))
        lengths.append((prompt, max(1, resp)))
    L = max(p + r for p, r in lengths)
    batch = {
        "input_ids": torch.zeros(rows, L, dtype=torch.long),
        "attention_mask": torch.zeros(rows, L, dtype=torch.bool),
        "loss_mask": torch.zeros(rows, L, dtype=torch.long),
    }
    for i, (p, r) in enumerate(lengths):
        batch["input_ids"][i, : p + r] = torch.randint(10, vocab, (p + r,), generator=g)
        batch["attention_mask"][i, : p + r] = True
        batch["loss_mask"][i, p : p + r] = 1
    return batch


def run_padded(model, batch, rows_per_mb: int) -> float:
    B = batch["input_ids"].shape[0]
    t = time.perf_counter()
    for s in range(0, B, rows_per_mb):
        rows = slice(s, s + rows_per_mb)
        n = int(batch["attention_mask"][rows].sum(-1).max())
        ids, am = batch["input_ids"][rows, :n], batch["attention_mask"][rows, :n]
        m = batch["loss_mask"][rows, :n].bool()
        logits = model(input_ids=ids, attention_mask=am.long(), use_cache=False).logits
        lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = -(lp * m[:, 1:]).sum()
        loss.backward()
    return time.perf_counter() - t


def run_packed(actor: FSDPPPOActor, batch, budget: int, policy_only: bool = False) -> float:
    valid = batch["attention_mask"]
    lengths = [int(valid[i].sum()) for i in range(valid.shape[0])]
    t = time.perf_counter()
    batch = dict(batch, pmask=batch["loss_mask"].bool())
    for rows in split_into_microbatches(lengths, MicroBatchSpec(max_tokens_per_mb=budget)):
        packed = pack_rows(batch, rows, ["pmask"], actor.device)
        if policy_only:
            lp = actor._policy_logp(actor.model, packed, packed["pmask"])[0]
        else:
            lp = next_token_logp(actor._forward(actor.model, packed), packed["input_ids"], packed["seq_start"])
        loss = -(lp * packed["pmask"]).sum()
        loss.backward()
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--rows-per-mb", type=int, default=8)
    ap.add_argument("--budget", type=int, default=2048, help="token budget of a packed micro-batch")
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    path = bench_model_path(args.model)
    actor = FSDPPPOActor(PPOActorConfig(path=path, device="cpu", threads=args.threads)).initialize()
    model = actor.model
    batch = ragged_batch(args.rows, model.config.vocab_size, args.max_len)
    real = int(batch["attention_mask"].sum())
    padded_tokens = 0
    for s in range(0, args.rows, args.rows_per_mb):
        mb = batch["attention_mask"][s : s + args.rows_per_mb]
        padded_tokens += mb.shape[0] * int(mb.sum(-1).max())
    n_params = sum(p.numel() for p in model.parameters()) / 1e6
    print(
        f"model {os.path.basename(path)} ({n_params:.1f} M params), {args.threads} threads; {args.rows} rows, "
        f"{real} real tokens; padded micro-batches of {args.rows_per_mb} rows hold {padded_tokens} "
        f"({1 - real / padded_tokens:.0%} padding); packed budget {args.budget} tokens"
    )

    run_padded(model, ragged_batch(4, model.config.vocab_size, 64, seed=1), 4)  # warm-up
    times = {"padded": [], "packed": [], "policy": []}
    for _ in range(args.repeats):  # interleaved, so background load hits all alike
        model.zero_grad(set_to_none=True)
        times["padded"].append(run_padded(model, batch, args.rows_per_mb))
        model.zero_grad(set_to_none=True)
        times["packed"].append(run_packed(actor, batch, args.budget))
        model.zero_grad(set_to_none=True)
        times["policy"].append(run_packed(actor, batch, args.budget, policy_only=True))
    best = {k: min(v) for k, v in times.items()}
    for k in times:
        print(f"{k:7s}: best {best[k]:.2f} s of {args.repeats}  ->  {real / best[k]:,.0f} real tokens/s")
    ratio = best["padded"] / best["packed"]
    print(f"packed / padded throughput: {ratio:.2f}x (target >= 1.5x): {'PASS' if ratio >= 1.5 else 'BELOW TARGET'}")
    print(f"policy / packed throughput: {best['packed'] / best['policy']:.2f}x (logits only where the loss reads them)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
