"""What machine this is, in the words a reader compares laptops by: CPU model, cores and vector ISA.

Why: the same notebook runs at very different speeds on an AVX-512 CPU and an AVX2-only one, so every time the
kit prints (`make demo`, each notebook's first cell, every bench's results file) says which CPU it came from. The
vector ISA is torch's own dispatch level (`torch.backends.cpu.get_cpu_capability()`: the kernels it really runs),
refined by `utils.device.cpu_native_bf16` where the CPU also computes bfloat16 in hardware.
"""

from __future__ import annotations

import os
import platform

__all__ = ["cpu_model", "describe", "describe_line", "usable_cores", "vector_isa"]


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (elsewhere what `platform` knows)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def vector_isa() -> str:
    """The vector instructions torch's CPU kernels use here: "AVX512", "AVX2", "NEON", ..., with " + BF16"/" + AMX"
    when bfloat16 runs in hardware too (what `cpu_native_bf16` reports)."""
    import torch

    from areal_lite.utils.device import cpu_native_bf16

    isa = torch.backends.cpu.get_cpu_capability()
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
