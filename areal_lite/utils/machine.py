"""What machine this is, in the words a reader compares laptops by: CPU model, cores and vector ISA (results files
add the CPU's family, model and stepping numbers, `cpu_id`, from which `cpu_generation` names its generation: a
VM's model name may not tell it).

Why: the same notebook runs at very different speeds on an AVX-512 CPU and an AVX2-only one, so every time the
kit prints (`make demo`, each notebook's first cell, every bench's results file) says which CPU it came from. The
vector ISA is torch's own dispatch level (`torch.backends.cpu.get_cpu_capability()`: the kernels it really runs),
refined by `utils.device.cpu_native_bf16` where the CPU also computes bfloat16 in hardware. The cores are those this
process may use (`usable_cores`): its affinity, capped by a container's CPU quota, which the affinity does not show and
which the trainer's and the server's thread counts must fit. A container's memory limit, which the host's free memory
does not show either, is `cgroup_memory_room` (`make check-machine` reads it).
"""

from __future__ import annotations

import math
import os
import platform
import subprocess
import sys
from typing import List, Optional, Tuple

__all__ = [
    "cgroup_cpu_limit",
    "cgroup_memory_room",
    "cpu_generation",
    "cpu_id",
    "cpu_model",
    "cpuinfo",
    "describe",
    "describe_line",
    "usable_cores",
    "vector_isa",
]


def cpuinfo(path: str = "/proc/cpuinfo") -> dict:
    """The first processor's block of `path` as {field: value} ({} where there is no such file: not Linux)."""
    fields: dict = {}
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if not sep:
                    if fields:
                        break  # the first processor's block is enough
                    continue
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo; on Arm Linux, whose cpuinfo has only part numbers, from `lscpu`
    ("Cortex-A76"); on macOS from `sysctl` ("Apple M2"); else what `platform` knows."""
    name = cpuinfo().get("model name")
    if not name and sys.platform == "darwin":
        name = _run(["sysctl", "-n", "machdep.cpu.brand_string"])
    elif not name and sys.platform.startswith("linux"):
        lines = _run(["lscpu"]).splitlines()
        name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Model name:")), "")
    return name or platform.processor() or platform.machine() or "unknown"


def _run(cmd: list) -> str:
    """A command's output, or "" where it is missing or fails."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def cpu_id(path: str = "/proc/cpuinfo") -> str:
    """The CPU's numbers from `path`, e.g. "family 6 model 207 stepping 2, cache 307200 KB" ("" where it has none).
    A virtual machine often names its CPU only "Intel(R) Xeon(R) Processor": two hosts of different generations
    then look alike, yet run at different speeds and may pick kernels that round differently."""
    fields = cpuinfo(path)
    names = (("family", "cpu family"), ("model", "model"), ("stepping", "stepping"))
    numbers = " ".join(f"{label} {fields[key]}" for label, key in names if fields.get(key))
    cache = fields.get("cache size", "")
    return ", ".join(part for part in (numbers, f"cache {cache}" if cache else "") if part)


# (family, first model, last model, name) of the x86 server generations a cloud VM is likely on, by /proc/cpuinfo's
# numbers (AMD's families 23-26 and Intel's 6 do not overlap); a VM names them all "AMD EPYC" or "Intel Xeon".
_GENERATIONS = (
    (23, 0x30, 0x7F, "Zen 2"),
    (25, 0x00, 0x0F, "Zen 3"),
    (25, 0x10, 0x1F, "Zen 4"),
    (25, 0x20, 0x5F, "Zen 3"),
    (25, 0x60, 0xAF, "Zen 4"),
    (26, 0x00, 0xFF, "Zen 5"),
    (6, 85, 85, "Skylake/Cascade Lake"),
    (6, 106, 106, "Ice Lake"),
    (6, 143, 143, "Sapphire Rapids"),
    (6, 207, 207, "Emerald Rapids"),
    (6, 173, 173, "Granite Rapids"),
)


def cpu_generation(numbers: str) -> str:
    """The generation `cpu_id`'s numbers ("family 25 model 1 stepping 1, ...") name: "Zen 3", "Sapphire Rapids", ...;
    "" for numbers this table does not know. A VM's model name ("AMD EPYC") hides it, yet an AVX2-only Zen 3 and an
    AVX-512 Zen 4 run the kit at speeds two to three times apart."""
    words = numbers.replace(",", " ").split()
    try:
        family, model = (int(words[words.index(key) + 1]) for key in ("family", "model"))
    except (ValueError, IndexError):
        return ""
    return next((name for f, lo, hi, name in _GENERATIONS if f == family and lo <= model <= hi), "")


def vector_isa() -> str:
    """The vector instructions torch's CPU kernels use here: "AVX512", "AVX2", "NEON", ..., with " + BF16"/" + AMX"
    when bfloat16 runs in hardware too (what `cpu_native_bf16` reports)."""
    import torch

    from areal_lite.utils.device import cpu_native_bf16

    isa = torch.backends.cpu.get_cpu_capability()
    if isa == "DEFAULT" and platform.machine().lower() in ("arm64", "aarch64"):
        isa = "NEON"  # torch names no level below SVE on 64-bit Arm, whose every CPU has NEON (its kernels use it)
    native = cpu_native_bf16()
    return f"{isa} + {native.replace('AVX-512 ', '')}" if native else isa


def usable_cores() -> int:
    """The cores this process may run on: its affinity where the OS says (Linux), else the machine's count, and no more
    than its cgroup's CPU quota allows (`cgroup_cpu_limit`)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    return max(1, min(cores, limit)) if limit else cores


def _cgroup_folders(controller: str, proc_cgroup: str, root: str) -> List[Tuple[int, str]]:
    """(cgroup version, folder) of every folder holding `controller`'s files for this process: in v2 its group and
    every group above it (each may set a limit); in v1 the controller's mount, under its own name ("cpu,cpuacct") or
    the controller's, at the group and at the root. [] where there is no /proc (not Linux)."""
    try:
        with open(proc_cgroup) as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
    except OSError:
        return []
    found: List[Tuple[int, str]] = []
    for _, controllers, path in lines:
        if controllers == "":
            parts = [p for p in path.split("/") if p]
            found += [(2, os.path.join(root, *parts[:depth])) for depth in range(len(parts), -1, -1)]
        elif controller in controllers.split(","):
            mounts = {os.path.join(root, m, g) for m in (controllers, controller) for g in (path.strip("/"), "")}
            found += [(1, folder) for folder in sorted(mounts)]
    return found


def cgroup_cpu_limit(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> Optional[int]:
    """The CPUs this process's cgroup quota gives it, rounded up (a container's `--cpus`, a Kubernetes pod's CPU limit,
    as on a JupyterHub), or None without a quota. The affinity still shows every core of the host there, and threads
    sized to it would take turns under the quota. cgroup v2: `cpu.max` ("200000 100000"; "max" is none) of the
    process's group and the groups above it; v1: `cpu.cfs_quota_us` / `cpu.cfs_period_us` (-1 is none)."""
    limits = []
    for version, folder in _cgroup_folders("cpu", proc_cgroup, root):
        if version == 2:
            quota, _, period = _read(os.path.join(folder, "cpu.max")).partition(" ")
        else:
            quota, period = _read(f"{folder}/cpu.cfs_quota_us"), _read(f"{folder}/cpu.cfs_period_us")
        if quota.isdigit() and period.isdigit() and int(period) > 0:  # "max" and "-1": no quota
            limits.append(int(quota) / int(period))
    return math.ceil(min(limits)) if limits else None


def cgroup_memory_room(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> Optional[int]:
    """Bytes this process's cgroup may still take (its memory limit less what the group uses: a container's
    `--memory`, a JupyterHub pod's limit), or None without a limit; the host's free memory does not show it. v2:
    `memory.max` and `memory.current`; v1: `memory.limit_in_bytes` and `memory.usage_in_bytes`."""
    rooms = []
    for version, folder in _cgroup_folders("memory", proc_cgroup, root):
        names = ("memory.max", "memory.current") if version == 2 else ("memory.limit_in_bytes", "memory.usage_in_bytes")
        limit, used = (_read(os.path.join(folder, name)) for name in names)
        if limit.isdigit() and used.isdigit() and int(limit) < 1 << 60:  # "max", and v1's page-rounded 2^63: none
            rooms.append(max(0, int(limit) - int(used)))
    return min(rooms) if rooms else None


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except (OSError, ValueError):
        return ""


def describe() -> dict:
    """{"cpu_model", "cores" (usable by this process), "vector_isa"}: one record for printing and for results files."""
    return {"cpu_model": cpu_model(), "cores": usable_cores(), "vector_isa": vector_isa()}


def describe_line() -> str:
    """One line for a log or a notebook: "CPU: <model>, <n> cores, <ISA>"."""
    m = describe()
    return f"CPU: {m['cpu_model']}, {m['cores']} cores, {m['vector_isa']}"
