"""The bench scripts' helpers: rollout_throughput's /proc helpers (CPU lists, binding a server to cores, the CPU time
of a process tree), update_speed's worker that times another source tree's update, the FLOP counts of _limit and
eval_cost, and report.py's tables."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from _bench import ROOT, load_bench

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc, uses sched_setaffinity")


bench = load_bench("rollout_throughput")


def test_cpu_lists_round_trip():
    assert bench.parse_cpu_list("0-2,5, 7-8") == [0, 1, 2, 5, 7, 8]
    assert bench.parse_cpu_list("3") == [3]
    assert bench.format_cpu_list([5, 0, 1, 2, 8, 7]) == "0-2,5,7-8"
    assert bench.format_cpu_list([0]) == "0"
    assert bench.parse_cpu_list(bench.format_cpu_list([0, 2, 3, 4, 9])) == [0, 2, 3, 4, 9]


def test_the_avx2_proxy_is_recorded_and_documented_as_one_switch_set(monkeypatch):
    machine = load_bench("_machine")
    for name in machine.AVX2_PROXY_ENV:
        monkeypatch.delenv(name, raising=False)
    assert machine.describe()["forced_isa"] == ""
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert machine.forced_isa() == "ONEDNN_MAX_CPU_ISA=AVX2"  # one switch alone is still a proxy
    # the whole proxy, in a fresh process (the libraries read their switches once): AVX2, no bf16 units (oneDNN's)
    code = "import json, sys; sys.path.insert(0, 'bench'); from _machine import describe; print(json.dumps(describe()))"
    env = {**os.environ, **machine.AVX2_PROXY_ENV, "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    record = json.loads(out.stdout.strip().splitlines()[-1])
    line = " ".join(f"{k}={v}" for k, v in machine.AVX2_PROXY_ENV.items())
    assert record["vector_isa"] == "AVX2" and record["forced_isa"] == line
    with open(os.path.join(ROOT, "docs", "benchmarks.md"), encoding="utf-8") as f:
        assert line in f.read()  # the command the docs give sets every switch the benches record


def test_a_results_file_names_the_cpus_numbers_beside_its_model(tmp_path):
    """A VM's model name can be only "Intel(R) Xeon(R) Processor": the record adds family, model, stepping and cache
    (the first processor's block of /proc/cpuinfo), and RESULTS.md shows them beside the name, with the generation
    they name."""
    machine, report = load_bench("_machine"), load_bench("report")
    info = tmp_path / "cpuinfo"
    block = "processor\t: {}\ncpu family\t: 6\nmodel\t\t: 207\nmodel name\t: Intel(R) Xeon(R) Processor\n"
    info.write_text(
        block.format(0) + "stepping\t: 2\ncache size\t: 307200 KB\n\n" + block.format(1) + "stepping\t: 9\n"
    )
    assert machine.cpu_id(str(info)) == "family 6 model 207 stepping 2, cache 307200 KB"
    info.write_text("processor\t: 0\nmodel name\t: Apple M2\n")
    assert machine.cpu_id(str(info)) == ""  # nothing to add: no numbers, no cache
    assert machine.cpu_id(str(tmp_path / "missing")) == ""
    assert set(machine.describe()) == {"cpu_model", "cores", "vector_isa", "cpu_id", "forced_isa"}
    rec = {"cpu_model": "Intel(R) Xeon(R) Processor", "cpu_id": "family 6 model 207 stepping 2", "date": "2026-11-30"}
    named = "Intel(R) Xeon(R) Processor (Emerald Rapids; family 6 model 207 stepping 2)"
    assert report.machine(rec)["cpu_model"] == named
    rec["cpu_id"] = "family 6 model 999 stepping 2"  # a generation `cpu_generation` does not know: the numbers alone
    assert report.machine(rec)["cpu_model"] == "Intel(R) Xeon(R) Processor (family 6 model 999 stepping 2)"
    assert report.machine({"cpu_model": "Apple M2", "date": "2026-11-30"})["cpu_model"] == "Apple M2"


def test_the_embedded_server_is_started_from_this_trees_package(tmp_path):
    """The bench starts `python -m <package>` in a source tree; the package moved as the kit grew."""
    module = bench.server_module(ROOT)
    probe = f"import importlib.util as u; print(u.find_spec('{module}.__main__'))"
    found = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert module.startswith("areal_lite.") and found.stdout.strip() != "None"
    old = tmp_path / "areal_lite" / "serve"
    old.mkdir(parents=True)
    (old / "__main__.py").write_text("")
    assert bench.server_module(str(tmp_path)) == "areal_lite.serve"
    with pytest.raises(SystemExit, match="no embedded server package"):
        bench.server_module(str(tmp_path / "areal_lite"))


@linux_only
@pytest.mark.parametrize("taskset", [True, False], ids=["taskset", "python-launcher"])
def test_bound_command_runs_on_the_cores_given(monkeypatch, taskset):
    if taskset and not bench.shutil.which("taskset"):
        pytest.skip("no taskset here")
    if not taskset:
        monkeypatch.setattr(bench.shutil, "which", lambda name: None)
    core = min(os.sched_getaffinity(0))
    cmd = bench.bound_command([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"], [core])
    assert subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip() == f"[{core}]"


# The child starts two grandchildren that each burn 0.3 s of CPU: A exits (the child reaps it, so its time moves to
# the child's cutime), B stays alive. Then the child says "ready" and sleeps.
CHILD = """
import subprocess, sys, time
burn = "import time\\nwhile time.process_time() < 0.3: pass\\n"
a = subprocess.Popen([sys.executable, "-c", burn])
b = subprocess.Popen(
    [sys.executable, "-c", burn + "print('burnt', flush=True)\\ntime.sleep(60)"], stdout=subprocess.PIPE
)
a.wait()
b.stdout.readline()
print("ready", flush=True)
time.sleep(60)
"""


@linux_only
def test_tree_cpu_seconds_counts_living_and_reaped_descendants():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        before = bench.tree_cpu_seconds(child.pid)
        assert child.stdout.readline().strip() == "ready"
        table = bench.proc_table()
        tree = bench.process_tree(child.pid, table)
        after = bench.tree_cpu_seconds(child.pid, table)
        assert tree[0] == child.pid and len(tree) == 2  # the child and B (A was reaped)
        assert os.getpid() not in tree
        assert 0.5 <= after - before < 3.0, (before, after)  # 2 x 0.3 s, in 10 ms clock ticks
        own, union, n = bench.tree_affinity(child.pid)
        assert n == 2 and set(bench.parse_cpu_list(union)) <= os.sched_getaffinity(0)
        assert bench.tree_cpu_seconds(10**9) == 0.0  # no such process: an empty tree
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()


def test_update_speed_baseline_worker_times_another_trees_update(tiny_model_path, vocab, tmp_path):
    # This tree stands in for the other one: the worker imports areal_lite from the tree it is given.
    us = load_bench("update_speed")
    actor = us.build_actor(tiny_model_path, "float32", 1)
    batch = us.make_batch(2, 3, 8, 4, vocab, common=3)
    batch["logprobs"] = batch["prox_logp"] = actor.compute_logp(batch)
    actor.compute_advantages(batch)
    n_params = sum(p.numel() for p in actor.model.parameters())
    actor.destroy()
    worker = us.BaselineTree(ROOT, batch, tiny_model_path, 1)
    try:
        assert worker.trainable_M == n_params / 1e6
        assert all(0 < worker.update() < 60 for _ in range(2))
    finally:
        worker.close()
    assert worker.proc.returncode == 0 and not os.path.exists(worker.tmp.name)  # its batch file is gone too
    with pytest.raises(RuntimeError, match="the baseline worker exited"):
        us.BaselineTree(ROOT, batch, str(tmp_path / "no-such-model"), 1)


# bench/_limit.py: the workload's FLOPs and the measured matmul limit ------------------------------------------------

limit = load_bench("_limit")


def smollm2_config():
    """SmolLM2-135M's shape (no download): hidden 576, MLP 1536, 30 layers, 9 heads of 64, 3 KV heads."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                       num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)  # fmt: skip


# Written out from the shape, by hand: multiply-adds of one token through one layer (q, k, v, o, gate/up/down), the LM
# head, and attention per (token, key) pair over the 30 layers (scores and weighted values), each x 2 FLOPs.
LAYER = 2 * (576 * 576 + 2 * 576 * (3 * 64) + 576 * 576 + 3 * 576 * 1536)
HEAD = 2 * 576 * 49152
PER_KEY = 2 * 2 * 9 * 64 * 30


def test_decode_flops_of_smollm2_by_hand():
    f = limit.decode_flops(smollm2_config(), rows=4, prompt_len=10, new_tokens=5)
    assert f["per_token_matmul"] == 30 * LAYER + HEAD == 268_959_744  # 2 x 134.5M multiply-adds
    assert abs(f["per_token_matmul"] / (2 * 134.5e6) - 1) < 0.001
    # prefill: 4 rows x 10 prompt tokens through the layers, the LM head on each row's last one, token i over i keys
    assert f["prefill"] == 4 * 10 * 30 * LAYER + 4 * HEAD + 4 * (1 + 2 + 3 + 4 + 5 + 6 + 7 + 8 + 9 + 10) * PER_KEY
    # decode: 4 more steps per row (the 5th token is sampled, never fed back), over 11, 12, 13 then 14 keys
    assert f["decode"] == 4 * 4 * (30 * LAYER + HEAD) + 4 * (11 + 12 + 13 + 14) * PER_KEY
    assert f["total"] == f["prefill"] + f["decode"]
    assert f["attention"] == 4 * (55 + 50) * PER_KEY
    # one length per row: the same as summing the rows apart
    mixed = limit.decode_flops(smollm2_config(), rows=2, prompt_len=[10, 12], new_tokens=5)
    ones = [limit.decode_flops(smollm2_config(), rows=1, prompt_len=n, new_tokens=5) for n in (10, 12)]
    assert mixed["total"] == sum(o["total"] for o in ones)


def test_a_shared_prefix_saves_prefill_only():
    config = smollm2_config()
    alone = limit.decode_flops(config, rows=4, prompt_len=10, new_tokens=5)
    shared = limit.decode_flops(config, rows=4, prompt_len=10, new_tokens=5, shared_prefix=6)
    assert shared["decode"] == alone["decode"]
    # the 3 rows after the first skip their 6 shared tokens: layers and the attention of positions 0-5 (1..6 keys)
    assert alone["prefill"] - shared["prefill"] == 3 * 6 * 30 * LAYER + 3 * (1 + 2 + 3 + 4 + 5 + 6) * PER_KEY
    with pytest.raises(ValueError):  # each row keeps its last prompt token: its logits sample the first new one
        limit.decode_flops(config, rows=4, prompt_len=10, new_tokens=5, shared_prefix=10)


def test_attention_grows_with_the_context():
    config = smollm2_config()
    short = limit.decode_flops(config, rows=2, prompt_len=10, new_tokens=8)
    long = limit.decode_flops(config, rows=2, prompt_len=100, new_tokens=8)
    assert long["per_token_matmul"] == short["per_token_matmul"]
    assert long["decode"] - short["decode"] == 2 * 7 * 90 * PER_KEY  # 7 steps per row, each over 90 more keys


def test_update_flops_of_the_demo_batch_by_hand():
    """One update of 2 prompts of 10 tokens (the first 4 common) x 3 completions of 5 tokens: the common start once,
    each prompt's 6 own tokens once, 4 of each completion's 5 tokens (the last is followed by nothing), the LM head
    once per prompt (its last position scores every first token of its group) and 4 times per row; backward = 2x."""
    f = limit.update_flops(smollm2_config(), groups=2, group_size=3, prompt=10, completion=5, common_start=4)
    assert f["positions"] == 4 + 2 * 6 + 6 * 4 and f["lm_head_positions"] == 2 + 6 * 4
    keys = (1 + 2 + 3 + 4) + 2 * (5 + 6 + 7 + 8 + 9 + 10) + 6 * (11 + 12 + 13 + 14)
    assert f["forward"] == 40 * 30 * LAYER + 26 * HEAD + keys * PER_KEY
    assert f["total"] == 3 * f["forward"] and f["attention"] == 3 * keys * PER_KEY
    # sharing saves work: no common start is 4 more positions (and their keys) for the second prompt
    assert limit.update_flops(smollm2_config(), 2, 3, 10, 5)["positions"] == f["positions"] + 4
    with pytest.raises(ValueError):  # each prompt keeps a token of its own: its last position scores the first token
        limit.update_flops(smollm2_config(), 2, 3, 10, 5, common_start=10)


def test_measure_peak_gflops_is_quick_and_restores_the_thread_count():
    import time

    import torch

    before = torch.get_num_threads()
    t0 = time.perf_counter()
    peak = limit.measure_peak_gflops(1, seconds=0.2, n=256)
    assert 0 < peak < 1e5 and time.perf_counter() - t0 < 3
    assert torch.get_num_threads() == before
    line = limit.fraction_line(limit.against_limit(100.0, {"total": 1e12, "tokens": 2048}, peak))
    assert "fraction of the limit" in line and f"{100 * 1e12 / 2048 / 1e9:.1f} GFLOP/s" in line


def test_report_shows_the_fraction_of_the_limit_when_a_run_has_it():
    import copy
    import json

    report = load_bench("report")
    with open(os.path.join(ROOT, "bench", "results", "rollout_throughput.json"), encoding="utf-8") as f:
        old = json.load(f)
    new = copy.deepcopy(old)
    for b in new["blocks"]:
        b["limit"] = {"peak_gflops": 100.0, "workload_flops": {}, "embedded_gflops": 25.0, "fraction": 0.25}
    text = "\n".join(report.latest_rollout(report.summarise_rollout(new)))
    assert "against the limit" in text and "25.0 of 100.0 GFLOP/s = 25.0%" in text
    assert "(25.0% of the limit)" in report.row_rollout(report.summarise_rollout(new))[0]
    assert "limit" not in "\n".join(report.latest_rollout(report.summarise_rollout(old)))  # older files: as before
    assert "matmul kernels" not in text  # a run without the kernels' figure: no line for it
    for b in new["blocks"]:
        b["limit"].update(kernel_gflops=60.0, kernel_fraction=0.6)
    text = "\n".join(report.latest_rollout(report.summarise_rollout(new)))
    assert "matmul kernels reach on their own" in text and "60.0 GFLOP/s = 60.0%" in text
    assert "(25.0% of the limit; kernels 60.0%) against " in report.row_rollout(report.summarise_rollout(new))[0]


def test_report_holds_the_update_against_the_limit_when_a_run_has_it():
    import copy
    import json

    report = load_bench("report")
    with open(os.path.join(ROOT, "bench", "results", "update_speed.json"), encoding="utf-8") as f:
        old = json.load(f)
    old.pop("update_flops", None)
    for r in old["rows"].values():
        r.pop("limit", None)
    new = copy.deepcopy(old)
    new["update_flops"] = {"total": 450e9}
    new["rows"]["float32 (default)"]["limit"] = {"peak_gflops": 200.0, "gflops": 150.0, "fraction": 0.75}
    text = "\n".join(report.latest_update_speed(report.summarise_update_speed(new)))
    assert "the update's 450 GFLOP of matmuls" in text and "float32 (default): 150 of 200 GFLOP/s = 75%" in text
    assert "Against the limit" not in "\n".join(report.latest_update_speed(report.summarise_update_speed(old)))


def test_kernel_ceiling_times_the_servers_own_matmuls_and_restores_the_thread_count(monkeypatch):
    """measure_kernel_gflops runs every weight matmul of the model's shapes through the fast path's `_Linear`, each
    weight once per pass: counted here by wrapping `_Linear.__call__`."""
    import torch
    from transformers import LlamaConfig

    from areal_lite.kit.server import fastpath

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000)  # fmt: skip
    shapes = []
    call = fastpath._Linear.__call__

    def counted(self, x):
        y = call(self, x)
        shapes.append((x.shape[0], x.shape[1], y.shape[1]))
        return y

    monkeypatch.setattr(fastpath._Linear, "__call__", counted)
    before = torch.get_num_threads()
    gflops = limit.measure_kernel_gflops(config, rows=8, threads=1, repeats=2)
    assert torch.get_num_threads() == before and gflops > 0
    one_pass = [(8, 64, 64 + 2 * 32), (8, 64, 64), (8, 64, 2 * 128), (8, 128, 64)] * 3 + [(8, 64, 1000)]
    assert shapes == one_pass * 3  # a warm-up pass, then two timed
    line = limit.fraction_line(limit.against_limit(100.0, {"total": 1e12, "tokens": 2048}, 200.0, 120.0))
    assert "the weight matmuls alone at the batch's rows 120.0 GFLOP/s, 0.600 of the limit" in line


def test_a_run_is_held_against_the_peak_measured_just_before_it():
    """With the peak measured before each run, the fraction is the median of the runs' own fractions: a CPU that
    slows down during the bench is not charged for it (median GFLOP/s over median peak would say 0.5 here)."""
    flops = {"total": 2e12, "tokens": 2000}  # 1 GFLOP a token: tok/s = GFLOP/s
    paired = [(60.0, 100.0), (40.0, 60.0), (50.0, 80.0)]  # the CPU's speed drifts; each run keeps pace with it
    lim = limit.against_limit(50.0, flops, 80.0, paired=paired)
    assert lim["fraction_runs"] == [0.6, 40.0 / 60.0, 0.625] and lim["fraction"] == 0.625
    assert lim["peak_runs"] == [100.0, 60.0, 80.0] and lim["embedded_gflops"] == 50.0
    line = limit.fraction_line(lim)
    assert "fraction of the limit 0.625 (the median of 3 runs' own, 0.600-0.667" in line and "60.0-100.0" in line
    assert "fraction_runs" not in limit.against_limit(50.0, flops, 80.0)  # one peak: median GFLOP/s over it
    report = load_bench("report")
    block = {"threads": 2, "limit": dict(lim)}
    assert "the median of the runs' fractions 62.5%" in report._against_limit(block)
    del block["limit"]["peak_runs"]
    assert report._against_limit(block).endswith("50.0 of 80.0 GFLOP/s = 62.5%")


def test_eval_cost_counts_the_work_the_server_ran():
    """Prefill runs each distinct prompt once and their shared start once; decode every answer token but the last."""
    eval_cost = load_bench("eval_cost")
    start, a, b = list(range(100, 109)), [1, 2, 3], [4, 5, 6]  # two 12-token prompts sharing their first 9 tokens
    rows = [(start + a, 4), (start + a, 4), (start + b, 2)]  # the first two are one prompt sampled twice
    width = 16
    ids = torch.zeros(3, width, dtype=torch.long)
    attn, loss = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (prompt, answer) in enumerate(rows):
        n = len(prompt) + answer
        ids[i, :n] = torch.tensor(prompt + [7] * answer)
        attn[i, :n] = 1
        loss[i, len(prompt) : n] = 1
    w = eval_cost.work({"input_ids": ids, "attention_mask": attn, "loss_mask": loss}, smollm2_config())
    assert (w["rows"], w["distinct_prompts"], w["shared_start"]) == (3, 2, 9)
    assert (w["prefill_positions"], w["decode_positions"]) == (9 + 3 + 3, 3 + 3 + 1)
    # every position through the layers; the LM head on each distinct prompt's last position and each decode step
    assert w["gflop"] * 1e9 == pytest.approx((15 + 7) * 30 * LAYER + (2 + 7) * HEAD)


def test_server_start_times_a_real_server_both_ways(tiny_model_path):
    """bench/server_start.py's one start: a real server launched, ready, its load time read from its ready line, and
    stopped; the same through transformers."""
    server_start = load_bench("server_start")
    for env in server_start.WAYS.values():
        r = server_start.start_once(tiny_model_path, 1, env)
        assert 0 <= r["loaded_s"] < r["ready_s"] and r["cpu_s"] > 0  # "loaded in" has one decimal: 0.0 for tiny


def test_report_lists_notebook_times_in_minutes():
    report = load_bench("report")
    record = {"notebooks": {"02_rewards": {"seconds": 30.0}, "01_setup": {"seconds": 45.0}}}
    figures = report.summarise_notebook_times(record)
    assert list(figures["minutes"]) == ["01_setup", "02_rewards"]
    text = "\n".join(report.latest_notebook_times(figures))
    assert "| 01_setup | 0.8 |" in text and "| 02_rewards | 0.5 |" in text and "| all | 1.2 |" in text
    assert report.row_notebook_times(figures) == ["2", "1.2"]


@linux_only
def test_peak_memory_counts_what_a_child_holds_and_the_kits_shm_files(tmp_path):
    """A child that holds 200 MiB of its own memory shows in the peak as "other" (the role of a process no pattern
    names), with the files of the kit's /dev/shm folders beside it; the peak is what was held, not a sum over time.
    Measured from a fresh process, whose only child is that one (this worker's may hold servers of earlier tests)."""
    memory = load_bench("memory")
    shm = tmp_path / "areal-lite-test" / "weights"
    shm.mkdir(parents=True)
    (shm / "model.safetensors").write_bytes(b"\1" * (8 << 20))
    script = f"""
import json, subprocess, sys
sys.path.insert(0, {os.path.join(ROOT, "bench")!r})
import memory
memory.SHM_FOLDERS = {str(tmp_path / "areal-lite-*")!r}
code = "import sys; b = bytearray(200 << 20); print('held', flush=True); sys.stdin.read()"
with memory.PeakMemory(interval=0.05) as peak:
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "held\\n"
    seen = peak.samples
    while peak.samples < seen + 2:  # two samples taken while the child holds its memory
        peak._stop.wait(0.05)
    child.communicate("")
print(json.dumps({{"at_peak": peak.at_peak, "peak": peak.peak}}))
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.splitlines()[-1])
    mib = 1 << 20
    assert 200 * mib <= result["at_peak"]["other"] < 260 * mib
    assert result["at_peak"]["weight versions in /dev/shm"] == 8 * mib
    assert result["peak"] == sum(result["at_peak"].values())
    assert memory.role(["python", "-m", "areal_lite.kit.server", "--port", "1"]) == "inference server"
    assert memory.role([sys.executable, "-m", "ipykernel_launcher", "-f", "k.json"]) == "notebook kernel"


def test_report_lists_each_runs_peak_memory_and_what_held_it():
    report = load_bench("report")
    record = {"runs": {"demo": {"peak_gib": 5.59, "at_peak_gib": {"demo": 3.26, "inference server": 1.47}},
                       "04_training": {"peak_gib": 6.07, "at_peak_gib": {"notebook kernel": 3.46}}}}  # fmt: skip
    figures = report.summarise_memory(record)
    text = "\n".join(report.latest_memory(figures))
    assert "| demo | 5.59 | demo 3.26; inference server 1.47 |" in text and "| 04_training | 6.07 |" in text
    assert report.row_memory(figures) == ["6.07 (04_training)"]


def test_a_notebook_is_timed_in_a_scratch_tree_with_its_sibling_notebooks(tmp_path):
    """As 04 runs 03's cells and 08 reads 05's, a timed notebook finds the notebooks beside it and ../../configs,
    and writes its runs into the scratch tree, not beside the original."""
    import nbformat

    notebook_times = load_bench("notebook_times")
    folder, configs = tmp_path / "notebooks" / "en", tmp_path / "configs"
    folder.mkdir(parents=True)
    configs.mkdir()
    (configs / "demo.yaml").write_text("seed: 1\n")
    sibling = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("answer = 42")])
    nbformat.write(sibling, folder / "01_first.ipynb")
    code = (
        "import nbformat, os\n"
        "assert nbformat.read('01_first.ipynb', as_version=4).cells[0].source == 'answer = 42'\n"
        "assert open('../../configs/demo.yaml').read() == 'seed: 1\\n'\n"
        "os.makedirs('runs'); open('runs/out.txt', 'w').write('x')"
    )
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code)]), folder / "02_second.ipynb")
    seconds = notebook_times.time_notebook(str(folder / "02_second.ipynb"), configs=str(configs))
    assert 0 < seconds < 120
    assert not (folder / "runs").exists()  # the scratch tree took it


def test_notebook_09s_tool_table_is_the_benchs_recorded_run():
    """Notebook 09's table of tool calls before training (both languages) and its 40-token figures are
    bench/tool_exploration.py's latest run, made with the notebook's own tool (read from its source)."""
    import re

    bench = load_bench("tool_exploration")
    record = json.load(open(os.path.join(ROOT, "bench", "results", "tool_exploration.json"), encoding="utf-8"))
    assert record["tools"] == bench.source_literal(bench.NOTEBOOK, "TOOLS")
    rows = {b: {(r["syntax"], r["examples"]): r for r in table} for b, table in record["tables"].items()}
    raw = open(bench.NOTEBOOK, encoding="utf-8").read()

    def numbers_after(first_cell: str) -> list:
        line = next((x for x in raw.splitlines() if x.startswith(first_cell)), None)
        assert line is not None, f"no row {first_cell!r} in notebook 09"
        return [int(n) for n in re.findall(r"\d+", line[len(first_cell) :])]

    for syntax, en, zh in (("hermes", "Hermes syntax", "Hermes 语法"), ("compact", "compact syntax", "紧凑语法")):
        calls, right, failures = (
            [rows["24"][(syntax, k)][key] for k in (0, 1, 2)] for key in ("calls", "right", "failures")
        )
        episodes = rows["24"][(syntax, 0)]["episodes"]
        assert numbers_after(f"| {en}, 0 / 1 / 2 worked examples |") == calls + [episodes] + right + failures
        assert numbers_after(f"| {zh}，0 / 1 / 2 个完整示例 |") == [episodes] + calls + right + failures
    unaided = rows["24"][("unaided", None)]
    accuracy = f"{unaided['correct'] / unaided['episodes']:.2f}"
    text = re.sub(r"\s+", " ", raw)
    assert f"(unaided: accuracy {accuracy})" in text and f"（无辅助：准确率 {accuracy}）" in text
    long = [rows["40"][("hermes", 2)]["calls"], rows["40"][("hermes", 2)]["episodes"]]
    long += [rows["40"][("compact", 1)]["calls"], rows["40"][("compact", 2)]["calls"]]
    en = "With 40 tokens Hermes + two examples reaches {} of {} calls, compact + one example {} and compact + two {}."
    zh = (
        "预算为 40 个 token 时，Hermes + 两个示例达到 {1} 次中 {0} 次调用，"
        "紧凑 + 一个示例 {2} 次，紧凑 + 两个示例 {3} 次。"
    )
    assert en.format(*long) in text and zh.format(*long) in text


def test_notebook_05s_prompt_table_is_the_benchs_recorded_run():
    """Notebook 05's table of prompts (both languages) is bench/search_prompts.py's latest run, made with the
    notebook's own instructions (read from its source), row for row."""
    bench, report = load_bench("search_prompts"), load_bench("report")
    record = json.load(open(os.path.join(ROOT, "bench", "results", "search_prompts.json"), encoding="utf-8"))
    assert record["system"]["notebook"] == bench.source_literal(bench.NOTEBOOK, "SYSTEM")
    assert [r["prompt"] for r in record["rows"]] == [v[0] for v in bench.VARIANTS]
    expected = [report.search_prompt_cells(r) for r in record["rows"]]
    lines = open(bench.NOTEBOOK, encoding="utf-8").read().splitlines()
    for header in (
        "| prompt | searched | answered | F1 reward | greedy |",
        "| 提示词 | 搜索了 | 作答了 | F1 奖励 | 贪心解码 |",
    ):
        start = lines.index(header) + 2  # past the header and its --- row
        rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[start : start + len(expected)]]
        assert [r[1:] for r in rows] == expected, f"notebook 05's table under {header!r} is not the bench's run"
    english = [line for line in lines if line.startswith("| ") and any(v[0] in line for v in bench.VARIANTS)]
    assert [line.split(" | ")[0][2:] for line in english] == [v[0] for v in bench.VARIANTS]


def test_write_results_records_where_and_what_ran(tmp_path):
    import argparse

    machine = load_bench("_machine")
    path = tmp_path / "results" / "x.json"
    record = machine.write_results(str(path), "x", argparse.Namespace(steps=3), ROOT, figures={"a": 1})
    assert json.loads(path.read_text()) == record
    assert record["bench"] == "x" and record["args"] == {"steps": 3} and record["figures"] == {"a": 1}
    assert {"date", "commit", "dirty", "cpu_model", "vector_isa", "forced_isa"} <= set(record)
    assert machine.write_results("", "x", argparse.Namespace(), ROOT)["bench"] == "x"  # "" writes nothing


def test_vs_trl_gives_trl_and_the_evaluator_the_reward_the_kit_trains_with():
    """TRL's reward and the held-out check are the kit's own: the demo's arithmetic check, not the GSM8K one (which
    pays a reply that restates "4 + 3")."""
    import argparse

    from areal_lite.kit.trainer.train import _load_run_data, build_eval_workflow, config_reward

    vs_trl = load_bench("vs_trl")
    config = vs_trl.load_config(argparse.Namespace(steps=1, threads=1, bf16=False))
    assert config_reward(config).__qualname__ == "arithmetic_reward_fn"
    evaluator = build_eval_workflow(config, _load_run_data(config).tokenizer)  # what eval_main scores with
    assert evaluator.reward_fn.__qualname__ == "arithmetic_reward_fn"
    assert evaluator.gconfig.greedy and evaluator.gconfig.n_samples == 1
    rows, fingerprints, reward = vs_trl.export_data(config, 1)
    assert reward == "areal_lite.reward.arithmetic:arithmetic_reward_fn"
    assert len(rows) == config.train_dataset.batch_size and len(fingerprints) == 1


def test_one_spread_format_for_every_bench():
    """The benches print and the report shows a spread the same way: median (lowest-highest)."""
    fmt = load_bench("_format")
    assert fmt.median_range([3.0, 1.0, 2.5]) == "2.5 (1.0-3.0)"
    assert fmt.median_range([0.5, 0.25], "{:.2f}", " s") == "0.38 s (0.25-0.50)"
    assert fmt.median_range([]) == "-"
    assert fmt.span(2.0, 1.0, 3.0, "{:.0f}", "×") == "2× (1-3)"
    report = load_bench("report")
    assert report.spread([2.0, 1.0, 3.0], "{:.0f}", "×") == fmt.span(2.0, 1.0, 3.0, "{:.0f}", "×")


def test_cpu_evidence_names_its_files_by_cpu_class(monkeypatch, capsys):
    """bench/cpu_evidence.py: the reference files on an AVX-512 CPU, `_avx2` on an AVX2-only one, `_avx2_proxy` when
    the proxy's switches are set; RESULTS.md titles such a file by its bench and CPU class."""
    ev = load_bench("cpu_evidence")
    for var in load_bench("_machine").AVX2_PROXY_ENV:
        monkeypatch.delenv(var, raising=False)
    for isa, tag in [("AVX512 + AMX", ""), ("AVX512", ""), ("AVX2", "_avx2"), ("NEON", "_neon")]:
        monkeypatch.setattr(ev, "describe", lambda isa=isa: {"vector_isa": isa})
        assert ev.cpu_tag() == tag
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert ev.cpu_tag() == "_avx2_proxy"
    assert ev.main(["--dry-run", "--only", "demo,eval", "--tag", "_avx2"]) == 0  # the plan, nothing run
    plan = capsys.readouterr().out
    assert "== demo_avx2: " in plan and "== eval_cost_avx2: " in plan and "== vs_trl" not in plan
    with pytest.raises(SystemExit, match="unknown steps"):
        ev.main(["--dry-run", "--only", "demos"])
    monkeypatch.delattr(os, "sched_setaffinity")  # macOS: the rollout bench cannot pin, so the run goes on without it
    assert ev.main(["--dry-run", "--only", "demo,rollout,eval"]) == 0
    plan = capsys.readouterr().out
    assert "skipping rollout_throughput" in plan and "== rollout_throughput" not in plan and "== eval_cost" in plan
    import areal_lite.utils.device as device  # update_speed's bf16 rows only where bf16 runs in hardware

    for native in (False, True):
        monkeypatch.setattr(device, "cpu_native_bf16", lambda native=native: native)
        update = next(argv for step, _, argv in ev.commands("_avx2", "python") if step == "update")
        assert ("--no-bf16" in update) is not native
    report = load_bench("report")
    assert report.title("demo_avx2") == report.TITLES["demo"] + ", an AVX2-only CPU"
    assert report.title("vs_trl_avx2_zen2") == report.TITLES["vs_trl"] + ", an AVX2-only CPU, zen2"  # a second one
    xeon = report.TITLES["vs_trl_bf16"] + ", another AVX-512 CPU, xeon"  # beside the AVX-512 reference files
    assert report.title("vs_trl_bf16_avx512_xeon") == xeon
    assert report.title("ci_time_avx2").startswith("`.ci/run` on a clean clone") and report.title("odd") == "odd"


def _demo_record(minutes_to_gain: list, rewards: list) -> dict:
    runs = []
    for m, r in zip(minutes_to_gain, rewards):
        line = f"greedy accuracy after N steps (minutes of training): 0: 0.44 (0.0), 4: 0.88 ({m}), 8: 0.96 (1.5)"
        runs.append({"lines": ["CPU: x", f"rewards by step: {r}", line, "greedy accuracy on 25 ..."]})
    return {"bench": "demo", "runs": runs}


def test_cpu_evidence_checks_each_target_against_the_records(tmp_path, monkeypatch):
    """The verdicts read the records: the demo's +0.4 within a minute in every run with equal rewards, generation's
    fraction of the limit, evaluation against generation, TRL's ratio, CI minutes."""
    ev = load_bench("cpu_evidence")
    assert ev.demo_verdict(_demo_record([0.5, 0.7], [[0.1], [0.1]]))[1]
    assert not ev.demo_verdict(_demo_record([0.5, 1.1], [[0.1], [0.1]]))[1]  # one run too slow
    assert not ev.demo_verdict(_demo_record([0.5, 0.5], [[0.1], [0.2]]))[1]  # the rewards differ run to run
    never = _demo_record([0.5], [[0.1]])
    never["runs"][0]["lines"][2] = "greedy accuracy after N steps (minutes of training): 0: 0.44 (0.0), 4: 0.80 (0.3)"
    assert not ev.demo_verdict(never)[1]
    records = {
        "demo_avx2": _demo_record([0.9], [[0.1]]),
        "rollout_throughput_demo_avx2": {"blocks": [{"threads": 2, "limit": {"fraction": 0.58}}]},
        "eval_cost_avx2": {"summary": {"time_ratio": 0.97, "work_ratio": 1.04}},
        "vs_trl_avx2": {"repeats": 3, "summary": {"trl_over_kit_median": 4.2}},
        "ci_time_avx2": {"seconds": 1250.0, "returncode": 0},
    }
    for name, rec in records.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(rec))
    monkeypatch.setattr(ev, "RESULTS", str(tmp_path))
    met = {target.split(":")[0].split(" >=")[0].split(" <=")[0]: ok for target, _, ok in ev.verdicts("_avx2")}
    assert met == {"demo": True, "generation": False, "evaluation": True, "vs_trl_avx2": True, ".ci/run": False}
    assert ev.verdicts("_other") == []  # no record of that CPU class: nothing claimed


def test_a_results_file_written_by_a_bench_does_not_make_the_tree_dirty(tmp_path):
    """`git_state` says "dirty" when the code measured differs from its commit, not when an earlier bench of the same
    run (bench/cpu_evidence.py) replaced a results file or RESULTS.md."""
    machine = load_bench("_machine")

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    (tmp_path / "bench" / "results").mkdir(parents=True)
    for name in ("code.py", "bench/RESULTS.md", "bench/results/demo.json"):
        (tmp_path / name).write_text("1\n")
    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    assert machine.git_state(str(tmp_path))["dirty"] is False
    (tmp_path / "bench" / "results" / "demo.json").write_text("2\n")
    (tmp_path / "bench" / "RESULTS.md").write_text("2\n")
    assert machine.git_state(str(tmp_path))["dirty"] is False
    (tmp_path / "code.py").write_text("2\n")
    assert machine.git_state(str(tmp_path))["dirty"] is True
