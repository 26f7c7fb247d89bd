"""Every speed figure the kit promises, measured on this CPU in one command, each checked against its target.

    PYTHONPATH=. .venv/bin/python bench/cpu_evidence.py [--only demo,rollout,...] [--ci] [--notebooks]
        [--tag TAG] [--allow-dirty] [--dry-run]

Runs, one after another on a quiet machine, the benches behind the kit's promises for a 2-core laptop: `demo`
(bench/demo.py), `rollout` (bench/rollout_throughput.py on the demo's rollout: 32 rows x 16 tokens), `eval`
(bench/eval_cost.py), `start` (bench/server_start.py), `update` (bench/update_speed.py), `trl` (bench/vs_trl.py;
`make trl` first; `--bf16` too where the CPU runs bf16 in hardware); with `--notebooks` bench/notebook_times.py
(every notebook, ~20-40 min) and with `--ci` `.ci/run` on a clean clone of HEAD (its seconds go to
bench/results/ci_time<tag>.json). Each writes bench/results/<name><tag>.json, the file before it archived into its
history first (`bench/report.py --archive`), then bench/RESULTS.md is regenerated. The tag names the CPU class:
none on an AVX-512 CPU (the reference files), `_avx2` on an AVX2-only one, `_avx2_proxy` under bench/_machine.py's
AVX2_PROXY_ENV, else the ISA's name; a second CPU of a class keeps the first's records with a word of its own
(`--tag _avx2_zen2`, `--tag _avx512_xeon`); notebook_times.json keeps its one name (tests/test_docs.py reads it).
Last it prints each target with the figure measured and whether it is met: the demo's +0.4 held-out accuracy within
1 min of training (every run, the same rewards run to run), generation at >= 60% of the compute limit on 2 cores,
an evaluation no dearer than a step's generation, TRL's time >= 4x the kit's, `.ci/run` <= 20 min.
Design decisions: the tree must be clean (the records name the commit measured); one bench at a time, since two
would share the cores; a failed bench stops the run, and what finished stays recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from _machine import describe, forced_isa, git_state, write_results  # noqa: E402

# step: (its results file's name, the bench's command line but its results-file option)
BENCHES = {
    "demo": ("demo", ["bench/demo.py"]),
    "rollout": (
        "rollout_throughput_demo",
        ["bench/rollout_throughput.py", "--requests", "32", "--max-new-tokens", "16", "--vllm-modes", "", "--no-raw"],
    ),
    "eval": ("eval_cost", ["bench/eval_cost.py"]),
    "start": ("server_start", ["bench/server_start.py"]),
    "update": ("update_speed", ["bench/update_speed.py"]),
    "trl": ("vs_trl", ["bench/vs_trl.py"]),
}
STEPS = tuple(BENCHES)


def cpu_tag() -> str:
    """'' on an AVX-512 CPU (the reference results files), '_avx2', '_avx2_proxy' or '_<isa>' elsewhere."""
    if forced_isa():
        return "_avx2_proxy"
    isa = describe()["vector_isa"].split()[0].lower()
    return "" if isa.startswith("avx512") else f"_{isa}"


def commands(tag: str, trl_python: str) -> list[tuple[str, str, list[str]]]:
    """(step, results name, argv) in the order they run; TRL's comparison once more in bf16 and update_speed's bf16
    rows only where the CPU has bf16 units (`cpu_native_bf16`)."""
    from areal_lite.utils.device import cpu_native_bf16

    runs = []
    for step, (name, argv) in BENCHES.items():
        out = os.path.join(RESULTS, f"{name}{tag}.json")
        if step == "update" and not cpu_native_bf16():
            argv = [*argv, "--no-bf16"]  # emulated bf16 (no AVX-512 BF16/AMX): its two rows take half an hour
        if step != "trl":
            runs.append((step, name + tag, [sys.executable, *argv, "--json", out]))
            continue
        trl = [sys.executable, *argv, "--trl-python", trl_python, "--out"]
        runs.append((step, name + tag, trl + [out]))
        if cpu_native_bf16():
            runs.append((step, f"vs_trl_bf16{tag}", trl + [os.path.join(RESULTS, f"vs_trl_bf16{tag}.json"), "--bf16"]))
    return runs


def archive(name: str) -> None:
    """Keep the results file a new run is about to replace (its history holds every earlier run)."""
    if os.path.exists(os.path.join(RESULTS, f"{name}.json")):
        note = "replaced by a later bench/cpu_evidence.py run"
        subprocess.run([sys.executable, "bench/report.py", "--archive", name, "--note", note], cwd=ROOT, check=True)


def run_ci(name: str, args: argparse.Namespace) -> None:
    """`.ci/run` on a clean clone of HEAD, timed; its seconds, exit status and last lines go to
    bench/results/<name>.json, with the clone's commit (what ran, whatever the working tree holds meanwhile)."""
    with tempfile.TemporaryDirectory(prefix="ci-evidence-") as tmp:
        clone = os.path.join(tmp, "clone")
        subprocess.run(["git", "clone", "-q", ROOT, clone], check=True)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "AREAL_LITE_CACHE")}
        t0 = time.perf_counter()
        proc = subprocess.run(["bash", ".ci/run"], cwd=clone, env=dict(env, CI="true"), capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        tail = [line for line in proc.stdout.splitlines() if line.strip()][-3:]  # pytest's summary, "CI finished"
        write_results(os.path.join(RESULTS, f"{name}.json"), "ci_time", args, clone, seconds=seconds,
                      returncode=proc.returncode, tail=tail)  # fmt: skip
    if proc.returncode:
        raise SystemExit(f".ci/run failed (exit {proc.returncode}): {tail}\n{proc.stderr[-2000:]}")


# ------------------------------------------------------------------------------------------------ the targets


def _load(name: str) -> dict | None:
    path = os.path.join(RESULTS, f"{name}.json")
    return json.load(open(path, encoding="utf-8")) if os.path.exists(path) else None


def demo_verdict(rec: dict) -> tuple[str, bool]:
    """+0.4 held-out greedy accuracy within 1 min of training in every run, and the same rewards in every run."""
    minutes = []
    for run in rec["runs"]:
        points = [(float(a), float(m)) for a, m in re.findall(r"\d+: ([\d.]+) \(([\d.]+)\)", run["lines"][2])]
        first = next((m for a, m in points if a - points[0][0] >= 0.4 - 1e-9), None)
        minutes.append(first)
    same = len({run["lines"][1] for run in rec["runs"]}) == 1
    ok = same and all(m is not None and m <= 1.0 for m in minutes)
    return f"+0.4 reached after {minutes} min of training; same rewards every run: {same}", ok


def verdicts(tag: str) -> list[tuple[str, str, bool]]:
    """(target, what the records say, met) for every record this CPU has."""
    out = []
    if rec := _load(f"demo{tag}"):
        out.append(("demo: +0.4 within 1 min of training", *demo_verdict(rec)))
    if rec := _load(f"rollout_throughput_demo{tag}"):
        two = next((b for b in rec["blocks"] if b["threads"] == 2), None)
        if two and "limit" in two:
            frac = two["limit"]["fraction"]
            out.append(("generation >= 60% of the limit, 2 cores (set for AVX2-only CPUs)", f"{frac:.1%}", frac >= 0.6))
    if rec := _load(f"eval_cost{tag}"):
        s = rec["summary"]
        out.append(("evaluation <= a step's generation", f"{s['time_ratio']:.2f}x its time, {s['work_ratio']:.2f}x "
                    "its work", s["time_ratio"] <= 1.0))  # fmt: skip
    for name in (f"vs_trl{tag}", f"vs_trl_bf16{tag}"):
        if rec := _load(name):
            ratio = rec["summary"]["trl_over_kit_median"]
            out.append(
                (f"{name}: TRL's time >= 4x the kit's", f"{ratio:.2f}x (median of {rec['repeats']})", ratio >= 4)
            )
    if rec := _load(f"ci_time{tag}"):
        minutes = rec["seconds"] / 60
        out.append((".ci/run <= 20 min", f"{minutes:.1f} min, exit {rec['returncode']}",
                    minutes <= 20 and rec["returncode"] == 0))  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(STEPS), help=f"comma-separated steps of {', '.join(STEPS)}")
    ap.add_argument("--notebooks", action="store_true", help="also every notebook, timed (bench/notebook_times.py)")
    ap.add_argument("--ci", action="store_true", help="also .ci/run on a clean clone of HEAD, timed")
    ap.add_argument("--tag", default=None, help="results-file suffix (default: from the CPU, see above)")
    ap.add_argument("--trl-python", default=os.path.join(ROOT, ".venv-trl", "bin", "python"))
    ap.add_argument("--allow-dirty", action="store_true", help="measure a tree with uncommitted changes")
    ap.add_argument("--dry-run", action="store_true", help="print the commands and the targets' verdicts only")
    args = ap.parse_args(argv)
    tag = cpu_tag() if args.tag is None else args.tag
    only = set(args.only.split(",")) - {""}
    if only - set(STEPS):
        raise SystemExit(f"--only: unknown steps {sorted(only - set(STEPS))}; the steps are {', '.join(STEPS)}")
    if git_state(ROOT)["dirty"] and not args.allow_dirty and not args.dry_run:
        raise SystemExit("the tree has uncommitted changes: commit them first (the records name the commit measured)")
    plan = [(name, cmd) for step, name, cmd in commands(tag, args.trl_python) if step in only]
    if "trl" in only and not os.path.exists(args.trl_python):
        print(f"skipping vs_trl: no {args.trl_python} (`make trl` installs it)")
        plan = [(n, c) for n, c in plan if not n.startswith("vs_trl")]
    if "rollout" in only and not hasattr(os, "sched_setaffinity"):  # macOS: the bench would stop the run
        print("skipping rollout_throughput: it pins the server to its cores, and this OS has no sched_setaffinity")
        plan = [(n, c) for n, c in plan if not n.startswith("rollout_throughput")]
    if args.notebooks:
        plan.append(("notebook_times", [sys.executable, "bench/notebook_times.py"]))
    print(f"{describe()} -> results tag {tag!r}")
    for name, cmd in plan + ([(f"ci_time{tag}", None)] if args.ci else []):
        print(f"== {name}: {' '.join(cmd) if cmd else '.ci/run on a clean clone'}", flush=True)
        if args.dry_run:
            continue
        archive(name)
        t0 = time.perf_counter()
        if cmd is None:
            run_ci(name, args)
        else:
            subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), check=True)
        print(f"== {name}: {time.perf_counter() - t0:.0f} s", flush=True)
    if not args.dry_run:
        subprocess.run([sys.executable, "bench/report.py"], cwd=ROOT, check=True)
    print("\ntargets (from the records of this CPU class):")
    for target, figure, ok in verdicts(tag):
        print(f"  {'met    ' if ok else 'NOT MET'}  {target}: {figure}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
