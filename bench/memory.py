"""How much memory `make demo` and each notebook take at their peak: what a laptop needs free to run them.

    PYTHONPATH=. .venv/bin/python bench/memory.py [NAME ...] [--no-demo] [--json bench/results/memory.json]
    make memory        (prepares the model and data first; about 30 min on a 2-core AVX-512 CPU)

Runs the demo (as `bench/demo.py` does) and the English notebooks (all, or those whose name contains a NAME; as
`bench/notebook_times.py` does: full budget, fresh kernel, scratch tree), one at a time, and samples every 0.25 s
what everything they start holds (this script's descendants: the demo or the kernel, its servers, reward workers):
each process's private memory (RssAnon: weights, optimizer state, activations, KV cache), once the largest mapped
file pages (RssFile: torch's libraries, mapped by every process from the same files, or an mmapped model file), and
the kit's `/dev/shm/areal-lite-*` files (weight versions in RAM). Records the peak of the sum and what each part
held then, with the date, commit and CPU (`_machine`); a results file from the same CPU keeps the runs not redone.

Design decisions
- Counters from /proc/<pid>/status, not PSS from smaps_rollup: smaps_rollup walks every page of a process, which for
  a multi-GB trainer four times a second takes CPU from the very run it measures; the counters are kept as they go.
- A sample every 0.25 s can miss a peak shorter than that (a weight write's copy): the READMEs round up.
- Linux only (/proc); elsewhere it stops and says so.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.join(ROOT, "tools")):
    if path not in sys.path:
        sys.path.insert(0, path)

from _machine import describe, write_results  # noqa: E402  (bench/ is on sys.path when a bench script runs)
from check_machine import kit_role  # noqa: E402  (tools/, put on sys.path above)

DEFAULT_JSON = os.path.join(ROOT, "bench", "results", "memory.json")
SHM_FOLDERS = "/dev/shm/areal-lite-*"


def status_bytes(pid: int) -> dict:
    """{"RssAnon": bytes, "RssFile": bytes} of process `pid` ({} if it has gone)."""
    found = {}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in ("RssAnon", "RssFile"):
                    found[key] = int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return {}
    return found


def shm_bytes(pattern: str | None = None) -> int:
    """Bytes of the files under the folders matching `pattern` (default `SHM_FOLDERS`; allocated blocks: what tmpfs
    holds in RAM)."""
    total = 0
    for top in glob.glob(pattern or SHM_FOLDERS):
        for folder, _, files in os.walk(top):
            for name in files:
                try:
                    total += os.lstat(os.path.join(folder, name)).st_blocks * 512
                except FileNotFoundError:  # removed while we walked: a version being replaced
                    pass
    return total


def role(cmdline: list) -> str:
    """What a process is, by its command line (`check_machine.kit_role`); the rest are "other" (reward workers)."""
    return kit_role(" ".join(cmdline)) or "other"


class PeakMemory:
    """Samples, in a thread, what this process's descendants hold (private memory, the largest one's file pages once)
    plus the kit's /dev/shm files; `.peak` is the largest sum in bytes, `.at_peak` what each part held then
    ({"inference server": bytes, ..., "mapped files (shared)": bytes, "weight versions in /dev/shm": bytes})."""

    def __init__(self, interval: float = 0.25):
        self.interval, self.peak, self.at_peak, self.samples = interval, 0, {}, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def sample(self) -> dict:
        import psutil

        held, files = {}, 0
        for child in psutil.Process().children(recursive=True):
            try:
                name = role(child.cmdline())
            except psutil.Error:  # gone between the listing and the look
                continue
            counts = status_bytes(child.pid)
            held[name] = held.get(name, 0) + counts.get("RssAnon", 0)
            files = max(files, counts.get("RssFile", 0))
        held["mapped files (shared)"] = files
        held["weight versions in /dev/shm"] = shm_bytes()
        return held

    def _run(self) -> None:
        while not self._stop.is_set():
            held = self.sample()
            self.samples += 1
            if sum(held.values()) > self.peak:
                self.peak, self.at_peak = sum(held.values()), held
            self._stop.wait(self.interval)


def measure(run, label: str) -> dict:
    """Run `run()` under a `PeakMemory`; its peak and breakdown in GiB, its wall seconds."""
    tik = time.perf_counter()
    with PeakMemory() as peak:
        run()
    gib = 1024**3
    parts = {k: round(v / gib, 2) for k, v in peak.at_peak.items() if v}
    record = {"peak_gib": round(peak.peak / gib, 2), "wall_s": round(time.perf_counter() - tik, 1),
              "samples": peak.samples, "at_peak_gib": parts}  # fmt: skip
    shown = ", ".join(f"{k} {v:.2f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))
    print(f"{label}: peak {record['peak_gib']:.2f} GiB ({shown}) in {record['wall_s']:.0f} s", flush=True)
    return record


def run_demo() -> None:
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as root:
        cmd = [sys.executable, "-m", "areal_lite.kit.trainer.demo", f"fileroot={root}"]
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"demo failed (exit {out.returncode}):\n{(out.stdout + out.stderr)[-4000:]}")


def main(argv: list | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="the notebooks whose name contains one of these (default: all)")
    ap.add_argument("--no-demo", action="store_true", help="leave out `make demo`")
    ap.add_argument("--json", default=DEFAULT_JSON, help="results file ('' for none)")
    args = ap.parse_args(argv)
    if not os.path.exists("/proc/self/status"):
        raise SystemExit("bench/memory.py reads /proc/<pid>/status: it runs on Linux only")
    from notebook_times import time_notebook

    runs = {}
    if args.json and os.path.exists(args.json):
        with open(args.json, encoding="utf-8") as f:
            old = json.load(f)
        if all(old.get(k) == v for k, v in describe().items()):
            runs = old.get("runs", {})  # the same CPU: keep what this run does not measure
    todo = [] if args.no_demo else [("demo", run_demo)]
    paths = sorted(glob.glob(os.path.join(ROOT, "notebooks", "en", "[0-9][0-9]_*.ipynb")))
    for path in [p for p in paths if not args.names or any(n in os.path.basename(p) for n in args.names)]:
        todo.append((os.path.basename(path)[: -len(".ipynb")], lambda path=path: time_notebook(path)))
    for name, run in todo:
        runs[name] = measure(run, "make demo" if name == "demo" else name)
        write_results(args.json, "memory", args, ROOT, runs=runs)  # after each: a stopped run keeps what it measured
    return 0


if __name__ == "__main__":
    sys.exit(main())
