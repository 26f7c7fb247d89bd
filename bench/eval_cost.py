"""What a held-out evaluation costs against one training step's generation, in seconds and in work.

    PYTHONPATH=. .venv/bin/python bench/eval_cost.py [--config configs/arith_grpo_demo.yaml] [--threads 2]
        [--repeats 11] [--json bench/results/eval_cost.json]

The workload is `make demo`'s: on one embedded server (`--threads`, default the config's), the kit's greedy
evaluation (`kit.trainer.train.evaluation_batch`, what `evaluate` runs: a fresh engine client, the
`evaluator.size` held-out rows, the run's reward pool) and one training step's generation (`rollout_batch` of the
next training batch through the config's grouped workflow, on a client made once, as the training loop does), taking
turns `--repeats` times after one warm-up each. The reward pool is started before any timing, as `train` starts it
beside the server's load.

Work is counted from what ran: the server's `/server_info` counters (prefill batches, decode steps, tokens
sampled) and the rows' prompts and answers. Matmul FLOPs per position through the layers and per LM-head call come
from the model's config (`bench/_limit.matmul_flops`); prefill runs each distinct prompt once and the start all
prompts share once (the server's `fastpath.shared_start`); decode runs every answer token but the last.
Attention (a few percent at these lengths) is left out. Printed and written to `--json`: seconds (median,
lowest-highest) and GFLOP of each, the time ratio eval / generation against the work ratio, and GFLOP/s of each:
equal rates mean the evaluation costs what its work costs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from _limit import matmul_flops  # noqa: E402  (bench/ is on sys.path when a bench script runs)
from _machine import write_results  # noqa: E402

COUNTERS = ("prefill_batches", "prompt_tokens", "decode_steps", "generated_tokens")


def counters(addr: str) -> dict:
    with urllib.request.urlopen(f"http://{addr}/server_info", timeout=30) as r:
        info = json.load(r)
    return {k: info[k] for k in COUNTERS}


def work(batch: dict, model_config) -> dict:
    """Matmul GFLOP of generating `batch` (padded rows: input_ids, attention_mask, loss_mask), as the server ran it."""
    from areal_lite.kit.server.fastpath import shared_start

    prompts, answers = [], []
    for ids, attn, loss in zip(batch["input_ids"], batch["attention_mask"], batch["loss_mask"]):
        n, first = int(attn.sum()), int(loss.nonzero()[0]) if loss.any() else int(attn.sum())
        prompts.append(tuple(ids[:first].tolist()))
        answers.append(n - first)
    distinct = sorted(set(prompts))
    shared = shared_start([list(p) for p in distinct]) if len(distinct) > 1 else 0
    prefill = shared + sum(len(p) - shared for p in distinct)
    decode = sum(max(a - 1, 0) for a in answers)  # the first token of a row comes from prefill; the last is not fed
    body, head, _ = matmul_flops(model_config)  # one position through the layers; one LM-head call
    gflop = ((prefill + decode) * body + (len(distinct) + decode) * head) / 1e9
    return {"rows": len(prompts), "distinct_prompts": len(distinct), "shared_start": shared,
            "prefill_positions": prefill, "decode_positions": decode, "gflop": gflop}  # fmt: skip


def main(argv: list | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "arith_grpo_demo.yaml"))
    ap.add_argument("--threads", type=int, default=0, help="server threads (0: the config's embedded.threads)")
    ap.add_argument("--repeats", type=int, default=11, help="turns of the two workloads (medians are compared)")
    ap.add_argument("--json", default=os.path.join(ROOT, "bench", "results", "eval_cost.json"), help="'' for none")
    args = ap.parse_args(argv)

    from transformers import AutoConfig

    from areal_lite.api.cli_args import load_expr_config
    from areal_lite.api.reward_api import AsyncRewardWrapper
    from areal_lite.engine.sglang_remote import RemoteSGLangEngine
    from areal_lite.kit.server.launch import launch_server
    from areal_lite.kit.trainer.train import (
        TrainConfig,
        _load_run_data,
        build_eval_workflow,
        build_workflow,
        config_reward,
        evaluation_batch,
    )
    from areal_lite.utils.data import concat_padded_tensors
    from areal_lite.utils.model_store import resolve_model_path

    overrides = [f"embedded.threads={args.threads}"] if args.threads else []
    config, _ = load_expr_config(["--config", args.config, *overrides], TrainConfig, verbose=False)
    data = _load_run_data(config)
    rewards = AsyncRewardWrapper(config_reward(config))
    rewards.start_workers().join()
    workflow = build_workflow(config, data.tokenizer, rewards)
    eval_workflow = build_eval_workflow(config, data.tokenizer, rewards)  # as `train` evaluates
    model_config = AutoConfig.from_pretrained(resolve_model_path(config.actor.path))
    server = launch_server(config, backend="embedded")
    addr = server.wait_ready(timeout=config.rollout.setup_timeout).address
    engine = RemoteSGLangEngine(config.rollout).initialize(addr=[addr])
    batches = iter(data.dataloader)

    def timed(kind: str) -> dict:
        before, t0 = counters(addr), time.perf_counter()
        if kind == "eval":  # what `evaluate` runs, as one batch (it returns only the means)
            batch = evaluation_batch([addr], data.valid_rows, eval_workflow, config.rollout)
        else:
            batch = concat_padded_tensors(engine.rollout_batch(next(batches), workflow))
        seconds, after = time.perf_counter() - t0, counters(addr)
        return {"seconds": seconds, **{k: after[k] - before[k] for k in COUNTERS}, **work(batch, model_config)}

    try:
        timed("eval"), timed("gen")  # warm-up
        runs = {"eval": [], "gen": []}
        for i in range(args.repeats):  # take turns, the order reversed every other turn: a shared machine drifts
            for kind in ("eval", "gen") if i % 2 == 0 else ("gen", "eval"):
                runs[kind].append(timed(kind))
    finally:
        engine.destroy()
        server.stop()
        rewards.shutdown()
    summary = {}
    for kind, rs in runs.items():
        secs = [r["seconds"] for r in rs]
        gflop = statistics.median(r["gflop"] for r in rs)
        summary[kind] = {"seconds": [statistics.median(secs), min(secs), max(secs)], "gflop": gflop,
                         "gflop_per_s": gflop / statistics.median(secs)}  # fmt: skip
    summary["time_ratio"] = summary["eval"]["seconds"][0] / summary["gen"]["seconds"][0]
    summary["work_ratio"] = summary["eval"]["gflop"] / summary["gen"]["gflop"]
    for kind, label in (("eval", "evaluation"), ("gen", "a step's generation")):
        s, r = summary[kind], runs[kind][0]
        secs = f"{s['seconds'][0]:.2f} s ({s['seconds'][1]:.2f}-{s['seconds'][2]:.2f}, n={len(runs[kind])})"
        print(f"{label:20s}: {secs}, "
              f"{r['rows']} rows from {r['distinct_prompts']} prompts, {r['prefill_batches']} prefill batch(es), "
              f"{r['decode_steps']} decode steps, {s['gflop']:.0f} GFLOP, {s['gflop_per_s']:.0f} GFLOP/s")  # fmt: skip
    print(f"evaluation / generation: {summary['time_ratio']:.2f}x the time for {summary['work_ratio']:.2f}x the work")
    write_results(args.json, "eval_cost", args, ROOT, runs=runs, summary=summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
