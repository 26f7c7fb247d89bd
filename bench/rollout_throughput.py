"""Rollout throughput of the embedded server: continuous batching vs one request at a time vs raw batched generate.

    .venv/bin/python bench/rollout_throughput.py [--model smollm2-135m-instruct] [--requests 32]
        [--max-new-tokens 64] [--threads 2] [--sequential-requests 8] [--repeats 2]

Three measurements on the same prompts, one after another (never concurrently), with the same torch thread count.
The concurrent and raw runs alternate `--repeats` times and their medians are compared (a busy machine drifts):
1. `concurrent`: all requests sent to the embedded server at once (it batches them continuously);
2. `one-by-one`: requests sent to the same server sequentially (each decodes alone; `--sequential-requests` of them,
   since a token rate does not need all 32);
3. `raw generate`: `model.generate` on the whole batch in this process (left-padded, B = --requests), no server.
Every request samples at temperature 1.0 with `ignore_eos` (raw generate: `min_new_tokens = max_new_tokens`), so all
three produce exactly max_new_tokens tokens per prompt. The server also returns logprobs, as rollouts need them.
Printed: tokens/s of each and the ratios concurrent / one-by-one (target >= 5x) and concurrent / raw (target >= 0.8).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import time
import urllib.request

QUESTIONS = [
    "What is {a} + {b}?", "Name a country that borders {c}.", "Write one sentence about the number {a}.",
    "What is the capital of {c}?", "Give a synonym of 'quick' and use it with {a}.", "Is {a} a prime number?",
    "Explain in one line why the sky looks blue.", "List two facts about {c}.",
]  # fmt: skip
COUNTRIES = ["France", "Peru", "Kenya", "Japan", "Norway", "Chile", "India", "Egypt"]


def prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        q = QUESTIONS[i % len(QUESTIONS)].format(a=7 * i + 3, b=11 * i + 5, c=COUNTRIES[i % len(COUNTRIES)])
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=3600) as r:
        return json.loads(r.read())


def body(ids: list[int], max_new_tokens: int) -> dict:
    return {"input_ids": ids, "return_logprob": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 1.0, "ignore_eos": True}}  # fmt: skip


def run_concurrent(url: str, ids: list[list[int]], max_new_tokens: int) -> tuple[int, float]:
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(ids)) as pool:
        outs = list(pool.map(lambda p: post(url, body(p, max_new_tokens)), ids))
    return sum(o["meta_info"]["completion_tokens"] for o in outs), time.perf_counter() - t0


def run_one_by_one(url: str, ids: list[list[int]], max_new_tokens: int) -> tuple[int, float]:
    t0 = time.perf_counter()
    tokens = sum(post(url, body(p, max_new_tokens))["meta_info"]["completion_tokens"] for p in ids)
    return tokens, time.perf_counter() - t0


class RawGenerate:
    """`model.generate` on the whole left-padded batch, in this process."""

    def __init__(self, path: str, ids: list[list[int]], threads: int):
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.pad = self.model.generation_config.pad_token_id or 0
        self.L = max(map(len, ids))
        self.input_ids = torch.tensor([[self.pad] * (self.L - len(p)) + p for p in ids])
        self.mask = torch.tensor([[0] * (self.L - len(p)) + [1] * len(p) for p in ids])
        self.run(4)  # warm-up

    def run(self, max_new_tokens: int) -> tuple[int, float]:
        with self.torch.inference_mode():
            t0 = time.perf_counter()
            out = self.model.generate(
                input_ids=self.input_ids, attention_mask=self.mask, max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                pad_token_id=self.pad,
            )  # fmt: skip
            dt = time.perf_counter() - t0
        return (out.shape[1] - self.L) * out.shape[0], dt


def report(name: str, tokens: int, dt: float, extra: str = "") -> float:
    print(f"{name:<13}: {tokens:5d} tokens in {dt:7.2f}s = {tokens / dt:7.1f} tok/s {extra}", flush=True)
    return tokens / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="alias or model folder")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sequential-requests", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2, help="paired concurrent/raw runs (medians are compared)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from transformers import AutoTokenizer

    from areal_lite.models import resolve_model_path

    path = resolve_model_path(args.model)
    ids = prompts(AutoTokenizer.from_pretrained(path), args.requests)
    print(f"model={path} requests={args.requests} prompt tokens={min(map(len, ids))}-{max(map(len, ids))} "
          f"max_new_tokens={args.max_new_tokens} threads={args.threads} cpus={os.cpu_count()} "
          f"load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    from areal_lite.config import EmbeddedServerConfig
    from areal_lite.launch import launch_server

    cfg = EmbeddedServerConfig(
        model_path=path, threads=args.threads, max_running_requests=len(ids), log_level="warning"
    )
    conc, raw = [], []
    with launch_server(cfg, backend="embedded") as handle:
        handle.wait_ready(timeout=600)
        url = handle.url + "/generate"
        post(url, body(ids[0], 4))  # warm-up
        # The raw model lives in this process while the server idles (an idle server uses no CPU), so the two
        # can alternate: on a busy machine, paired runs are fairer than one long run of each.
        baseline = RawGenerate(path, ids, args.threads)
        for _ in range(args.repeats):
            conc.append(report("concurrent", *run_concurrent(url, ids, args.max_new_tokens), f"(B={len(ids)}, server)"))
            raw.append(report("raw generate", *baseline.run(args.max_new_tokens), f"(B={len(ids)}, in-process)"))
        seq = report("one-by-one", *run_one_by_one(url, ids[: args.sequential_requests], args.max_new_tokens),
                     f"({args.sequential_requests} requests, server)")  # fmt: skip
        with urllib.request.urlopen(handle.url + "/server_info") as r:
            info = json.loads(r.read())
    conc_m, raw_m = statistics.median(conc), statistics.median(raw)
    print(f"server: max running batch {info['max_running_batch']}, {info['decode_steps']} decode steps, "
          f"{info['prefill_batches']} prefill batches; load average now {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(f"concurrent / one-by-one   = {conc_m / seq:5.2f}x  (target >= 5x)")
    print(f"concurrent / raw generate = {conc_m / raw_m:5.2f}   (target >= 0.80; median of {args.repeats} paired runs)")


if __name__ == "__main__":
    sys.exit(main())
