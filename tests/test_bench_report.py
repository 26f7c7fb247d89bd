"""bench/report.py: bench/RESULTS.md is what the results files generate, every latest results file says where and when
it ran, and the generator puts a bench's latest run first and its earlier runs below it."""

from __future__ import annotations

import datetime
import json
import os
import re
import statistics

import pytest
from _bench import ROOT, load_bench

report = load_bench("report")
RESULTS = os.path.join(ROOT, "bench", "results")


def test_results_md_is_what_the_results_files_generate():
    with open(os.path.join(ROOT, "bench", "RESULTS.md"), encoding="utf-8") as f:
        committed = f.read()
    assert committed == report.render(RESULTS), "bench/RESULTS.md is out of date: run `make bench-report`"


@pytest.mark.parametrize("name", sorted(f[:-5] for f in os.listdir(RESULTS) if f.endswith(".json")))
def test_every_latest_results_file_names_its_machine_date_and_commit(name):
    with open(os.path.join(RESULTS, f"{name}.json"), encoding="utf-8") as f:
        data = json.load(f)
    assert data.get("vector_isa"), f"{name}.json records no vector ISA"
    m = report.machine(data)
    assert m["cpu_model"] != "not recorded" and m["vector_isa"] != "not recorded"
    assert isinstance(m["cores"], int) and m["cores"] >= 1
    assert re.fullmatch(r"[0-9a-f]{40}", m["commit"]), m["commit"]
    datetime.datetime.strptime(m["date"], "%Y-%m-%d %H:%M")


def test_every_history_record_is_complete():
    keys = {"bench", "commit", "date", "cpu_model", "vector_isa", "cores", "figures", "note"}
    history = os.path.join(RESULTS, "history")
    for file in sorted(os.listdir(history)):
        with open(os.path.join(history, file), encoding="utf-8") as f:
            records = json.load(f)
        assert records and all(keys <= set(r) and r["bench"] == file[:-5] for r in records), file
        assert all(re.fullmatch(r"[0-9a-f]{40}", r["commit"]) and r["figures"] for r in records), file


def vs_trl_run(commit: str, date: str, kit: list, trl: list, acc_after=(0.96, 0.92)) -> dict:
    """A results file shaped as bench/vs_trl.py writes it, with the given train times per repeat."""
    runs = []
    for i, (k, t) in enumerate(zip(kit, trl)):
        for system, s, acc in (("kit", k, acc_after[0]), ("trl", t, acc_after[1])):
            phases = {"generate": s / 2, "update": s / 2}
            runs.append({"system": system, "repeat": i, "train_s": s, "phase_s": phases, "accuracy_after": acc})

    def side(times: list, acc: float) -> dict:
        return {"train_s_median": statistics.median(times), "train_s_min": min(times), "train_s_max": max(times),
                "accuracy_after_median": acc, "cpu_s_median": 2 * statistics.median(times)}  # fmt: skip

    ratios = [t / k for k, t in zip(kit, trl)]
    summary = {"trl_over_kit_train_time": ratios, "trl_over_kit_median": statistics.median(ratios)}
    summary.update(kit=side(kit, acc_after[0]), trl=side(trl, acc_after[1]))
    return {"commit": commit, "date": date, "cpu_model": "Test CPU 9000", "vector_isa": "AVX512 + BF16", "cores": 4,
            "threads": 2, "steps": 16, "repeats": len(kit), "prompts_per_step": 4, "group_size": 8,
            "base_accuracy": 0.44, "runs": runs, "summary": summary}  # fmt: skip


def write(path, data) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)


@pytest.fixture
def results(tmp_path):
    """A results folder: vs_trl's latest run and two earlier ones, and an update_speed file from before `vector_isa`
    and `cores` were recorded."""
    latest = vs_trl_run("a" * 40 + "-dirty", "2026-12-02 10:00:00", [60.0, 62.0, 70.0], [200.0, 210.0, 231.0])
    old = vs_trl_run("b" * 40, "2026-11-30 09:00:00", [90.0, 95.0, 99.0], [270.0, 280.0, 300.0], (1.0, 0.92))
    older = vs_trl_run("c" * 40, "2026-11-29 08:00:00", [100.0, 101.0, 102.0], [240.0, 250.0, 260.0])
    write(tmp_path / "vs_trl.json", latest)
    history = [report.record("vs_trl", older, "the oldest"), report.record("vs_trl", old, "the middle one")]
    write(tmp_path / "history" / "vs_trl.json", history + [report.record("vs_trl", latest, "listed as latest")])
    rows = {
        "float32, rows whole": {"seconds": [8.0, 9.0, 7.0], "median": 8.0, "speedup": 1.0, "trainable_M": 134.5},
        "float32 (default)": {"seconds": [2.0, 2.5, 2.2], "median": 2.2, "speedup": 8 / 2.2, "trainable_M": 134.5},
    }
    args = {"groups": 4, "group_size": 8, "repeats": 3, "threads": 2}
    write(tmp_path / "update_speed.json", {"args": args, "date": "2026-12-01 12:00:00", "commit": "d" * 40,
                                           "cpu": "Old CPU", "native_bf16": "none", "rows": rows})  # fmt: skip
    return tmp_path


def test_latest_run_first_with_its_machine_then_earlier_runs_newest_first(results):
    text = report.render(str(results))
    vs_trl, update_speed = text.split("## One PPO update")
    assert "Latest run: commit aaaaaaa (dirty), 2026-12-02 10:00, Test CPU 9000, AVX512 + BF16, 4 cores" in vs_trl
    assert "| train time, s: median (lowest-highest) | 62.0 (60.0-70.0) | 210.0 (200.0-231.0) |" in vs_trl
    assert "**3.33×** (3.33, 3.39, 3.30)" in vs_trl and "0.44 → 0.96" in vs_trl
    latest, earlier = vs_trl.split("### Earlier runs")
    assert "bbbbbbb" not in latest and "ccccccc" not in latest
    middle, oldest = earlier.index("| 2026-11-30 09:00 | bbbbbbb |"), earlier.index("| 2026-11-29 08:00 | ccccccc |")
    assert middle < oldest  # newest first
    assert "| 95.0 (90.0-99.0) | 280.0 (270.0-300.0) | 3.00× (2.95-3.03) | 1.00 / 0.92 | the middle one |" in earlier
    assert "aaaaaaa" not in earlier and "listed as latest" not in earlier  # the latest run is not listed twice
    # a file from before `vector_isa` and `cores`: the CPU under its old key, the ISA not recorded, cores = threads
    assert "commit ddddddd, 2026-12-01 12:00, Old CPU, not recorded, 2 cores" in update_speed
    assert "| float32 (default) | 2.20 (2.00-2.50) | 3.64× | 134.5 |" in update_speed
    assert "### Earlier runs" not in update_speed
    assert report.render(str(results)) == text  # nothing from the clock or the file system's order


def test_the_machines_matmul_speed_during_the_runs_is_reported_where_recorded(results):
    """vs_trl.py measures a large torch.mm before each run: the report gives their range, and says nothing of it for
    a record from before it was measured (the fixture's)."""
    assert "The machine's speed while it ran" not in report.render(str(results))
    latest = vs_trl_run("f" * 40, "2026-12-04 10:00:00", [60.0, 62.0], [200.0, 210.0])
    for run, gflops in zip(latest["runs"], (131.0, 140.4, 178.6, 150.0)):
        run["host_mm_gflops"] = gflops
    write(results / "vs_trl.json", latest)
    text = report.render(str(results))
    assert "a large float32 `torch.mm` on 2 threads measured before each run: 131-179 GFLOP/s." in text


def test_an_avx2_proxy_run_says_so(results):
    """A run on an AVX-512 CPU told to use AVX2 kernels (bench/_machine.py's AVX2_PROXY_ENV) is not that CPU's own."""
    proxy = vs_trl_run("e" * 40, "2026-12-03 10:00:00", [80.0], [300.0])
    proxy["forced_isa"] = "ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2"
    write(results / "vs_trl.json", proxy)
    assert "Test CPU 9000, AVX512 + BF16 (AVX2 proxy), 4 cores" in report.render(str(results))
    assert "(AVX2 proxy)" not in report.machine({**proxy, "forced_isa": ""})["vector_isa"]


def test_the_gpu_check_reports_its_gpu_tests_and_notebooks(results):
    nb = {"01_setup": {"rc": 0, "seconds": 30.2, "passed": 13}, "10_lora": {"rc": 1, "seconds": 95.0, "failed": 1}}
    run = {"bench": "gpu", "date": "2026-12-04 10:00:00", "commit": "f" * 40, "dirty": False, "dry_run": False,
           "torch": "2.11.0+cu130", "cuda": True, "gpu": "NVIDIA H200", "cpu_model": "Host CPU", "cores": 16,
           "vector_isa": "AVX512", "smoke": False, "tests": {"rc": 0, "passed": 5, "failed": 0, "skipped": 2},
           "notebooks": nb}  # fmt: skip
    write(results / "gpu.json", run)
    text = report.render(str(results)).split("## The GPU check")[1]
    assert "GPU: NVIDIA H200, torch 2.11.0+cu130; notebooks at full budget." in text
    assert "`tests/test_gpu.py`: 5 passed, 0 failed, 2 skipped." in text
    assert "| 01_setup | passed | 30 |" in text and "| 10_lora | FAILED | 95 |" in text


def test_check_says_when_the_file_is_stale_and_archive_keeps_a_run_once(results, capsys):
    out = str(results / "RESULTS.md")
    args = ["--results", str(results), "--out", out]
    assert report.main(args) == 0 and report.main(args + ["--check"]) == 0
    with open(out, "a", encoding="utf-8") as f:
        f.write("typed by hand\n")
    assert report.main(args + ["--check"]) == 1
    assert "out of date" in capsys.readouterr().out
    os.remove(results / "history" / "vs_trl.json")
    assert report.main(args + ["--archive", "vs_trl", "--note", "before the next run"]) == 0
    with open(results / "history" / "vs_trl.json", encoding="utf-8") as f:
        (rec,) = json.load(f)
    assert rec["commit"] == "a" * 40 and rec["dirty"] and rec["note"] == "before the next run"
    assert rec["figures"]["kit"]["train_s"] == [62.0, 60.0, 70.0]
    with pytest.raises(SystemExit, match="already holds"):
        report.main(args + ["--archive", "vs_trl"])


def test_a_bf16_comparison_has_its_own_section_saying_both_sides_precision(results):
    """`vs_trl.py --bf16` writes vs_trl_bf16.json: a section of its own, whose first line says that both sides ran
    under bf16 autocast and what the kit's precision plan chose on that CPU; the float32 section says float32."""
    run = vs_trl_run("e" * 40, "2026-12-03 10:00:00", [50.0, 52.0], [200.0, 210.0])
    said = "areal-lite: actor.dtype=bfloat16 on CPU: ... forward passes under bf16 autocast (this CPU has AMX; ...)"
    for r in run["runs"]:
        r["precision"] = said if r["system"] == "kit" else "torch.float32 weights, accelerate mixed_precision=bf16"
    write(results / "vs_trl_bf16.json", dict(run, bench="vs_trl", hyperparameters={"bf16": True}))
    text = report.render(str(results))
    fp32, bf16 = text.split("## The kit against TRL's GRPOTrainer, both under bf16 autocast (`bench/vs_trl.py --bf16`)")
    assert "alternating; TRL as installed; float32 both sides." in fp32
    assert f'bf16 autocast both sides (TRL\'s `bf16=True`; the kit said: "{said}")' in bf16.split("\n## ")[0]
    assert "**4.02×** (4.00, 4.04)" in bf16  # the median of the two repeats
