"""`make demo` on this machine, recorded: what it prints, for README.md's demo block, and its minutes.

    PYTHONPATH=. .venv/bin/python bench/demo.py [--repeats 3] [--json bench/results/demo.json]

Runs `python -m areal_lite.kit.trainer.demo` (what `make demo` runs once the model and data are prepared)
`--repeats` times, each in a fresh child process writing its run folder to a temporary `fileroot`, and records
each run's summary lines as printed (the CPU, the rewards by step, greedy accuracy every 4 steps with the minutes
of training before it, the held-out line) and its wall seconds, with the date, commit and CPU (`_machine`).

Design decisions
- README.md's demo block is the latest record's first run, line for line (tests/test_docs.py holds them equal),
  so what the README shows is what ran here, not typed by hand.
- The demo's own code prints the lines; this script only runs it and keeps them: nothing is re-derived.
- Same seed, same rewards: a repeat shows the spread of the minutes; the rewards line is the same in every run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from _machine import write_results  # noqa: E402

# The lines README.md shows, by how each starts (the demo prints them in this order).
SUMMARY = ("CPU: ", "rewards by step: ", "greedy accuracy after N steps", "greedy accuracy on ")


def summary_lines(stdout: str) -> list[str]:
    """The demo's summary lines from its stdout: the first line naming the CPU, then the three result lines."""
    lines = stdout.splitlines()
    found = [next((line for line in lines if line.startswith(p)), "") for p in SUMMARY]
    missing = [p.strip() for p, line in zip(SUMMARY, found) if not line]
    if missing:
        raise SystemExit(f"demo: its output has no line starting with {missing}:\n{stdout[-3000:]}")
    return found


def run_demo() -> dict:
    """One `make demo` run in a child process: its summary lines and wall seconds."""
    with tempfile.TemporaryDirectory(prefix="bench-demo-") as root:
        cmd = [sys.executable, "-m", "areal_lite.kit.trainer.demo", f"fileroot={root}"]
        t0 = time.perf_counter()
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"demo failed (exit {out.returncode}):\n{(out.stdout + out.stderr)[-4000:]}")
    return {"lines": summary_lines(out.stdout), "wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="demo runs, one after another")
    ap.add_argument("--json", default=os.path.join(ROOT, "bench", "results", "demo.json"), help="results file")
    args = ap.parse_args(argv)
    runs = []
    for i in range(args.repeats):
        runs.append(run_demo())
        print(f"run {i}: {runs[-1]['wall_s']:.0f} s", *runs[-1]["lines"], sep="\n  ", flush=True)
    write_results(args.json, "demo", args, ROOT, runs=runs)
    print(f"results: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
