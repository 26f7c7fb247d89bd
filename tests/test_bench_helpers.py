"""The bench scripts' helpers: rollout_throughput's /proc helpers (CPU lists, binding a server to cores, the CPU time
of a process tree) and update_speed's worker that times another source tree's update."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from _bench import ROOT, load_bench

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc, uses sched_setaffinity")


bench = load_bench("rollout_throughput")


def test_cpu_lists_round_trip():
    assert bench.parse_cpu_list("0-2,5, 7-8") == [0, 1, 2, 5, 7, 8]
    assert bench.parse_cpu_list("3") == [3]
    assert bench.format_cpu_list([5, 0, 1, 2, 8, 7]) == "0-2,5,7-8"
    assert bench.format_cpu_list([0]) == "0"
    assert bench.parse_cpu_list(bench.format_cpu_list([0, 2, 3, 4, 9])) == [0, 2, 3, 4, 9]


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
