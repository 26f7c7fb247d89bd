"""Will this machine run the kit? One look before a workshop: Python, system, CPU, cores, memory, disk and /dev/shm.
Also the kit's servers and Jupyter kernels already running, whose memory and cores a new notebook would share.
`make demo` and `make lab` run it with `--before-run` first: silent unless memory, cores or a running kit fall short.

    make check-machine        (python3 tools/check_machine.py; needs no venv, runs in a second)

Each line says ok, or what falls short and what to do. Exit status 1 where `make` would refuse the machine (a Python
or system torch 2.13.0 has no wheel for), else 0: too little memory or one core is a warning, as a notebook may still
run. The memory asked for is the recorded peaks (bench/results/memory.json: `make demo` and each notebook, run alone),
the disk the README's figure. Free memory is what the system could hand out now (Linux: MemAvailable, within a
container's memory limit, as on a JupyterHub; macOS: free and inactive pages): close programs and look again.
Standard library only, like `check_python.py`, whose checks it repeats.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _machine_module():
    """areal_lite/utils/machine.py (standard library only), loaded by path: no venv, no package import."""
    path = os.path.join(ROOT, "areal_lite", "utils", "machine.py")
    spec = importlib.util.spec_from_file_location("_kit_machine", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


machine = _machine_module()
MEMORY = os.path.join(ROOT, "bench", "results", "memory.json")
DISK_GB = 3.3  # README.md: `make test`'s venv and the converted model; `make demo` alone needs about 2
GIB = 1024**3


def free_memory() -> int | None:
    """Bytes of memory the system could give a new program now, or None where this cannot tell."""
    if sys.platform == "darwin":
        try:
            out = subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        pages = {k.strip(): v.strip().rstrip(".") for k, _, v in (line.partition(":") for line in out.splitlines())}
        size = int(out.split("page size of ")[1].split()[0]) if "page size of " in out else 16384
        counts = [pages.get(k, "") for k in ("Pages free", "Pages inactive", "Pages speculative")]
        return sum(int(c) for c in counts if c.isdigit()) * size or None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return None
    available = fields.get("MemAvailable", "").split()
    if not available or not available[0].isdigit():
        return None
    free, room = int(available[0]) * 1024, machine.cgroup_memory_room()
    return free if room is None else min(free, room)


def recorded_peaks(path: str = MEMORY) -> dict:
    """{"demo": GiB, "01_setup": GiB, ...} from bench/memory.py's record ({} without one)."""
    try:
        with open(path, encoding="utf-8") as f:
            return {name: run["peak_gib"] for name, run in json.load(f)["runs"].items()}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def memory_line(free: int | None, peaks: dict) -> str:
    """What `free` bytes allow of the recorded `peaks` (GiB), as one line."""
    if free is None:
        return "memory: cannot tell how much is free here; the largest notebook needs about {:.1f} GiB".format(
            max(peaks.values(), default=0)
        )
    gib = free / GIB
    if not peaks:
        return f"memory: {gib:.1f} GiB free (no record of the notebooks' peaks: bench/results/memory.json)"
    short = sorted(name for name, peak in peaks.items() if peak > gib)
    largest = max(peaks, key=peaks.get)
    if not short:
        return f"memory: {gib:.1f} GiB free: ok (the largest peak, {largest}, is {peaks[largest]:.1f} GiB)"
    names = ", ".join("make demo" if n == "demo" else n[:2] for n in short)
    return (
        f"memory: {gib:.1f} GiB free: too little for {names} (up to {peaks[largest]:.1f} GiB); close other "
        "programs and look again, or use a 16 GB machine or Colab (notebooks/README.md: Out of memory)"
    )


def cpu_line(model: str, flags: str, arch: str) -> str:
    """The CPU and which of the READMEs' two time figures to plan with: the first was measured on an AVX-512 CPU, the
    second on an AVX2-only one (`flags`: /proc/cpuinfo's)."""
    have = set(flags.split())
    if "avx512f" in have:
        return f"cpu: {model}, AVX-512: plan with the first time figure of the notebook tables"
    if "avx2" in have:
        return f"cpu: {model}, AVX2 only: plan with the second (slower) time figure of the notebook tables"
    return (f"cpu: {model} ({arch}): no time figure was measured on this kind of CPU; after `make test`, time a "
            "notebook: PYTHONPATH=. .venv/bin/python bench/notebook_times.py 04 --json runs/times.json")  # fmt: skip


def cores_line(cores: int) -> str:
    if cores >= 2:
        return f"cores: {cores} usable: ok"
    return "cores: 1 usable: everything runs, but slower than the times quoted (measured on 2 cores)"


def disk_line(free: int) -> str:
    gb = free / 1e9
    if gb >= DISK_GB:
        return f"disk: {gb:.0f} GB free here: ok (about {DISK_GB} GB needed)"
    return f"disk: {gb:.1f} GB free here: too little (about {DISK_GB} GB needed for .venv and the model)"


def shm_line(total: int | None) -> str:
    """Whether /dev/shm (`total` bytes) can hold a SmolLM2 weight version, about 0.5 GiB in float32; with less the kit
    writes them under the run folder instead (`utils.weight_dirs`)."""
    if total is None:
        return "/dev/shm: none here: weight versions are written to disk (runs/), a little slower"
    if total < 0.55 * GIB:
        return (f"/dev/shm: {total / 1024**2:.0f} MB, less than one weight version (about 0.5 GiB): they are written "
                "to disk (runs/) instead, a little slower")  # fmt: skip
    return f"/dev/shm: {total / GIB:.1f} GiB: ok"


# What the kit runs, by a command line's mark: its servers, the Jupyter kernels that start them, `make demo`
# (bench/memory.py names the processes it measures by the same list).
KIT_PROCESSES = (("inference server", "areal_lite.kit.server"), ("retrieval server", "areal_lite.kit.rag"),
                 ("notebook kernel", "ipykernel"), ("demo", "areal_lite.kit.trainer.demo"))  # fmt: skip


def kit_role(args: str) -> str | None:
    """Which of `KIT_PROCESSES` the command line `args` is, or None."""
    return next((name for name, mark in KIT_PROCESSES if mark in args), None)


def kit_processes(ps_output: str) -> list:
    """[(role, pid, resident bytes)] of the kit's processes (`kit_role`) in `ps -axo pid=,rss=,args=`'s output."""
    found = []
    for line in ps_output.splitlines():
        pid, rss, args = (line.split(None, 2) + ["", "", ""])[:3]
        role = kit_role(args)
        if role and pid.isdigit() and rss.isdigit() and int(pid) != os.getpid():
            found.append((role, int(pid), int(rss) * 1024))
    return found


def running_line(found: list) -> str:
    """Whether kit processes already run: two notebooks at once take each other's memory and cores."""
    if not found:
        return "running: no kit server or notebook kernel: ok"
    held = sum(size for _, _, size in found) / GIB
    names = ", ".join(f"{role} {pid}" for role, pid, _ in found)
    return (f"running: {names} ({held:.1f} GiB): the free memory below is what they leave; shut down the kernels "
            "you are done with (JupyterLab: Kernel, Shut Down Kernel), which stops their servers")  # fmt: skip


def main(argv: list | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--before-run",
        action="store_true",
        help="only what could stop a run now (cores, the kit already running, memory), and only if short",
    )
    ap.add_argument("--runs", default="", help="with the memory check: these runs only, comma-separated (demo,04)")
    args = ap.parse_args(argv)
    from check_python import pick  # tools/ is this script's folder, on sys.path when it runs

    peaks = recorded_peaks()
    if args.runs:
        wanted = args.runs.split(",")
        peaks = {name: peak for name, peak in peaks.items() if any(name.startswith(w) for w in wanted)}
    try:
        ps = subprocess.run(["ps", "-axo", "pid=,rss=,args="], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        ps = ""
    now = [cores_line(machine.usable_cores()), running_line(kit_processes(ps)), memory_line(free_memory(), peaks)]
    if args.before_run:  # printed by `make demo` and `make lab` before they start: silent when all is well
        for line in now:
            if ": ok" not in line:
                print(f"check-machine: {line}")
        return 0
    executable, note = pick(sys.executable, given=False)  # note: the other Python make takes, or why none will do
    if executable is None:
        print(f"python/system: {note}")
    else:
        version = "{}.{}.{}".format(*sys.version_info[:3])
        print(f"python: {note or f'{version} ({sys.executable})'}: ok")
    print(f"system: {platform.system()} {platform.machine()}")
    print(cpu_line(machine.cpu_model(), machine.cpuinfo().get("flags", ""), platform.machine()))
    print(*now, sep="\n")
    print(disk_line(shutil.disk_usage(ROOT).free))
    if sys.platform.startswith("linux"):
        print(shm_line(shutil.disk_usage("/dev/shm").total if os.path.isdir("/dev/shm") else None))
    return 1 if executable is None else 0


if __name__ == "__main__":
    try:
        status = main()
        sys.stdout.flush()  # inside the try: a reader that left early (`| head`) is met here or in a print
    except BrokenPipeError:  # Python's documented way to end quietly: stdout to devnull, so exit's flush is silent
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        status = 0
    sys.exit(status)
