"""`make areal-run` recorded: AReaL 1.0.4's own trainer on notebook 08's export, its runs' seconds and steps.

    PYTHONPATH=. .venv/bin/python bench/areal_run.py [--export runs/areal_export] [--steps 2]
        [--json bench/results/areal_run.json]

Runs `areal_lite.kit.areal.run.run_all` (what `make areal-run` runs once notebook 08 has exported the experiment):
`--steps` steps under AReaL's `PPOTrainer`, then a second run that must resume from AReaL's own checkpoint and train
one step more. Records each run's exit code and seconds and, per step, AReaL's task reward, actor loss and step time
(its printed table), with the date, commit and CPU (`_machine`). docs/areal-run.md quotes the latest record.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from _machine import write_results  # noqa: E402

from areal_lite.kit.areal.run import SHOWN, run_all  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", default=os.path.join(ROOT, "runs", "areal_export"), help="notebook 08's export")
    ap.add_argument("--steps", type=int, default=2, help="training steps of the first run")
    ap.add_argument("--json", default=os.path.join(ROOT, "bench", "results", "areal_run.json"), help="results file")
    args = ap.parse_args(argv)
    if not os.path.exists(os.path.join(args.export, "search_agent_areal.py")):
        raise SystemExit(f"areal_run: no export in {args.export}: `make areal-run` executes notebook 08 first")
    code, runs = run_all(os.path.abspath(args.export), args.steps)

    def table(steps: dict) -> dict:  # AReaL's stats by step, the three `make areal-run` prints
        return {str(k): {name: v.get(key) for name, key in SHOWN.items()} for k, v in sorted(steps.items())}

    shown = [{"what": r["what"], "exit": r["exit"], "seconds": round(r["seconds"], 1), "steps": table(r["steps"])}
             for r in runs]  # fmt: skip
    write_results(args.json, "areal_run", args, ROOT, exit=code, runs=shown)
    print(f"results: {args.json}")
    return code


if __name__ == "__main__":
    sys.exit(main())
