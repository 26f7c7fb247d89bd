"""How long an embedded server takes to start: its model loaded without transformers (the fast path's lean load)
against through transformers, each a fresh process, from launch to ready.

    PYTHONPATH=. .venv/bin/python bench/server_start.py [--model smollm2-135m-instruct] [--threads 2] [--repeats 5]
        [--json bench/results/server_start.json]

Each start is `python -m areal_lite.kit.server --model-path M --threads T` on a free port: `lean` as the kit starts
it, `transformers` with `AREAL_LITE_SERVER_TRANSFORMERS=1` (`kit/server/weights.py`: the load goes through
transformers, the same fast path serves). Timed from the launch to the server's "ready" line, with the model's load
(the server's own "loaded in" figure) and the process's CPU seconds (getrusage of the reaped child). The two take
turns `--repeats` times and medians are compared, because a shared machine drifts. Printed and written to `--json`
(with the commit, CPU model, cores and vector ISA): seconds to ready, median (lowest-highest), per way, and their
ratio. Every notebook and most integration tests start servers, so this is paid dozens of times in `make test`.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from _format import median_range  # noqa: E402
from _machine import write_results  # noqa: E402

from areal_lite.utils.network import find_free_port  # noqa: E402

WAYS = {"lean": {}, "transformers": {"AREAL_LITE_SERVER_TRANSFORMERS": "1"}}


def start_once(model: str, threads: int, extra_env: dict) -> dict:
    """Launch one server, wait for its ready line, stop it: seconds to ready, its load time, CPU seconds."""
    cmd = [sys.executable, "-m", "areal_lite.kit.server", "--model-path", model, "--threads", str(threads),
           "--port", str(find_free_port())]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": str(threads), **extra_env}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ready, loaded, tail = None, None, []
    for line in proc.stdout:
        tail = (tail + [line])[-20:]
        if "areal-lite serve: ready on" in line:
            ready = time.perf_counter() - t
            loaded = float(line.rsplit("(loaded in ", 1)[1].split("s)")[0])
            break
    proc.terminate()
    proc.communicate(timeout=60)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if ready is None:
        raise SystemExit("server_start: the server exited before it was ready:\n" + "".join(tail))
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"ready_s": ready, "loaded_s": loaded, "cpu_s": cpu}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=os.path.join(ROOT, "bench", "results", "server_start.json"))
    args = ap.parse_args()
    from areal_lite.utils.model_store import prepare_model

    path = prepare_model(args.model)
    runs: dict[str, list[dict]] = {way: [] for way in WAYS}
    start_once(path, args.threads, {})  # warm-up: the OS's file cache holds the libraries and the weights
    for r in range(args.repeats):
        for way in WAYS if r % 2 == 0 else list(WAYS)[::-1]:
            runs[way].append(start_once(path, args.threads, WAYS[way]))
            print(f"{way:12s} #{r}: ready in {runs[way][-1]['ready_s']:.2f} s", flush=True)
    summary = {
        way: {k: statistics.median(x[k] for x in rs) for k in ("ready_s", "loaded_s", "cpu_s")}
        for way, rs in runs.items()
    }
    summary["transformers_over_lean"] = summary["transformers"]["ready_s"] / summary["lean"]["ready_s"]
    print(f"\n{'way':12s} {'ready, s':>22s} {'model load, s':>22s} {'CPU s':>22s}")
    for way, rs in runs.items():
        cells = [median_range([x[k] for x in rs], "{:.2f}") for k in ("ready_s", "loaded_s", "cpu_s")]
        print(f"{way:12s} {cells[0]:>22s} {cells[1]:>22s} {cells[2]:>22s}")
    print(f"through transformers / lean, time to ready: {summary['transformers_over_lean']:.2f}x")
    write_results(args.json, "server_start", args, ROOT, model=args.model, runs=runs, summary=summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
