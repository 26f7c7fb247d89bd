"""What machine this is, in the words a reader compares laptops by: CPU model, cores and vector ISA (results files
add the CPU's family, model and stepping numbers, `cpu_id`: a VM's model name may not tell its generation).

Why: the same notebook runs at very different speeds on an AVX-512 CPU and an AVX2-only one, so every time the
kit prints (`make demo`, each notebook's first cell, every bench's results file) says which CPU it came from. The
vector ISA is torch's own dispatch level (`torch.backends.cpu.get_cpu_capability()`: the kernels it really runs),
refined by `utils.device.cpu_native_bf16` where the CPU also computes bfloat16 in hardware.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

__all__ = ["cpu_id", "cpu_model", "cpuinfo", "describe", "describe_line", "usable_cores", "vector_isa"]


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
    """The CPU's model name from /proc/cpuinfo, on macOS from `sysctl` ("Apple M2"), else what `platform` knows."""
    name = cpuinfo().get("model name") or (_sysctl("machdep.cpu.brand_string") if sys.platform == "darwin" else "")
    return name or platform.processor() or platform.machine() or "unknown"


def _sysctl(key: str) -> str:
    """`sysctl -n key` (macOS), or "" where it fails."""
    try:
        out = subprocess.run(["sysctl", "-n", key], capture_output=True, text=True, timeout=10)
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
    """The cores this process may run on: its affinity where the OS says (Linux), else the machine's count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def describe() -> dict:
    """{"cpu_model", "cores" (usable by this process), "vector_isa"}: one record for printing and for results files."""
    return {"cpu_model": cpu_model(), "cores": usable_cores(), "vector_isa": vector_isa()}


def describe_line() -> str:
    """One line for a log or a notebook: "CPU: <model>, <n> cores, <ISA>"."""
    m = describe()
    return f"CPU: {m['cpu_model']}, {m['cores']} cores, {m['vector_isa']}"
