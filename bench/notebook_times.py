"""Each notebook's wall time on this machine, run as a learner runs it: top to bottom, alone, in a fresh kernel.

    PYTHONPATH=. .venv/bin/python bench/notebook_times.py [NAME ...] [--json bench/results/notebook_times.json]
    make notebook-times        (prepares the model and data first; about 20 min on a 2-core AVX-512 Xeon)

Runs the English notebooks (all, or those whose name contains a NAME) one after another with the build tool's
`execute` (nbclient, a fresh kernel, full budgets: `AREAL_LITE_SMOKE` unset), each in a scratch copy of the
repository's layout and from no earlier run, and records the wall seconds of each with the date, commit, CPU model,
cores and vector ISA. Nothing is written back: the committed outputs stay the reference run's. A results file from
the same CPU keeps the notebooks this run did not time, so a slow machine can time them in parts.

Why: the READMEs give each notebook's CPU minutes as a range, from the reference run (the Xeon that built the
notebooks) to an AVX2-only CPU. With a results file from an AVX2-only CPU, the second figure is its measured time;
without one, the reference time scaled by 2.2 (the ratio measured between such a CPU and the Xeon on `make demo`
and the whole suite). tests/test_docs.py holds the READMEs to whichever applies.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.join(ROOT, "tools")):
    if path not in sys.path:
        sys.path.insert(0, path)

from _machine import describe, git_state, write_json  # noqa: E402  (bench/ is on sys.path when a bench script runs)

DEFAULT_JSON = os.path.join(ROOT, "bench", "results", "notebook_times.json")


def main(argv: list | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="time the notebooks whose name contains one of these (default: all)")
    ap.add_argument("--json", default=DEFAULT_JSON, help="results file ('' for none)")
    args = ap.parse_args(argv)

    paths = sorted(glob.glob(os.path.join(ROOT, "notebooks", "en", "[0-9][0-9]_*.ipynb")))
    paths = [p for p in paths if not args.names or any(n in os.path.basename(p) for n in args.names)]
    machine, tree = describe(), git_state(ROOT)
    # forced_isa: an AVX2 proxy's switches (bench/_machine.py), "" where the CPU runs its own best kernels
    result = {"bench": "notebook_times", **machine, "notebooks": {}}
    if args.json and os.path.exists(args.json):
        with open(args.json, encoding="utf-8") as f:
            old = json.load(f)
        if all(old.get(k) == result[k] for k in ("cpu_model", "vector_isa", "forced_isa")):
            result["notebooks"] = old.get("notebooks", {})  # the same CPU: keep what this run does not time
    for path in paths:
        name = os.path.basename(path)[: -len(".ipynb")]
        print(f"{name} ...", flush=True)
        seconds = time_notebook(path)
        print(f"  {seconds:.1f} s ({seconds / 60:.1f} min)", flush=True)
        result["notebooks"][name] = {"seconds": seconds, "date": time.strftime("%Y-%m-%d %H:%M:%S"), **tree}
        if args.json:  # after each notebook: a run stopped halfway keeps what it timed
            save(result, args.json)
    return 0


def time_notebook(path: str, configs: str = os.path.join(ROOT, "configs")) -> float:
    """Wall seconds of notebook `path` run top to bottom by the build tool's `execute`, in a scratch tree shaped like
    the repository (the notebooks read ../../configs and write runs/ and ../../runs): it starts from no earlier run,
    and a learner's own runs stay where they are. The notebooks beside it are there too, read-only (04 runs 03's
    cells, 08 reads 05's)."""
    import nbformat
    from build_notebooks import execute

    with tempfile.TemporaryDirectory(prefix="notebook-times-") as scratch:
        os.symlink(configs, os.path.join(scratch, "configs"))
        folder = os.path.join(scratch, "notebooks", "en")
        os.makedirs(folder)
        for other in glob.glob(os.path.join(os.path.dirname(os.path.abspath(path)), "*.ipynb")):
            if os.path.abspath(other) != os.path.abspath(path):
                os.symlink(other, os.path.join(folder, os.path.basename(other)))
        nb = execute(nbformat.read(path, as_version=4), folder)
    return nb.metadata["areal_lite"]["reference_run"]["wall_seconds"]


def save(result: dict, path: str) -> None:
    """`result` with the date and commit of its newest notebook, as `path`."""
    latest = max(result["notebooks"].values(), key=lambda r: r["date"], default={"date": "", "commit": ""})
    result.update(date=latest["date"], commit=latest.get("commit", ""), dirty=latest.get("dirty", False))
    write_json(path, result)


if __name__ == "__main__":
    sys.exit(main())
