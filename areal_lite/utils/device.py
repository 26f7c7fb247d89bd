"""Where torch runs and with how many threads.

Design decisions: `pick_device("auto")` takes CUDA, else MPS, else the CPU, and an explicit name that is not
available is an error rather than a silent fallback. On a 2-core laptop the server and the trainer share the cores,
so threads per process go through one rule, `capped_threads` (the config's count, capped by `OMP_NUM_THREADS`).
`cpu_native_bf16` says whether this CPU computes bfloat16 in hardware (AVX-512 BF16 or AMX): without it, bf16 matmuls
are emulated and slower than float32, so the actor only autocasts to bf16 where it pays.
"""

from __future__ import annotations

import os

import torch

__all__ = ["capped_threads", "cpu_native_bf16", "set_torch_threads", "pick_device"]


def capped_threads(n: int) -> int:
    """`n` threads capped by `OMP_NUM_THREADS` when that is set (`n <= 0`, torch's default, stays as it is).

    Configs ask for threads per process (a trainer that takes turns with its server may use both cores of a laptop);
    the environment variable is the machine-wide say. `make test` sets it to 1 because it runs two notebooks at once
    on two cores, where a second OpenMP thread only spin-waits for a descheduled sibling (a process can slow ~10x).
    Both the trainer (`set_torch_threads`) and the launcher of a server process go through this one rule.
    """
    cap = os.environ.get("OMP_NUM_THREADS", "").strip()
    if n > 0 and cap.isdigit() and int(cap) > 0:
        return min(n, int(cap))
    return n


def set_torch_threads(n: int) -> int:
    """`torch.set_num_threads(capped_threads(n))`; returns the count in effect (`n <= 0` leaves torch's default)."""
    n = capped_threads(n)
    if n > 0:
        torch.set_num_threads(n)
    return torch.get_num_threads()


def pick_device(preferred: str = "auto") -> torch.device:
    """ "auto" -> cuda, else mps, else cpu. Explicit names are honoured, with a clear error if unavailable."""
    preferred = (preferred or "auto").strip().lower()
    if preferred == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(preferred)
    except RuntimeError as e:
        raise ValueError(f"unknown device {preferred!r} (use auto, cpu, cuda, cuda:N or mps)") from e
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {preferred!r} requested but CUDA is not available; use 'auto' or 'cpu'")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise RuntimeError(f"device {preferred!r} requested but only {torch.cuda.device_count()} CUDA device(s)")
    elif device.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise RuntimeError(f"device {preferred!r} requested but MPS is not available; use 'auto' or 'cpu'")
    return device


def cpu_native_bf16() -> str:
    """This CPU's native bfloat16 instructions, "AMX" or "AVX-512 BF16", or "" when it has neither.

    torch 2.x exposes the checks as private `torch.cpu._is_amx_tile_supported` / `_is_avx512_bf16_supported`
    (`torch.backends.cpu.get_cpu_capability()` only names the vector width, "AVX512" with or without BF16); a torch
    without them, or one whose check fails, counts as "no", the safe answer (float32 is never the slow choice).
    """
    for name, what in (("_is_amx_tile_supported", "AMX"), ("_is_avx512_bf16_supported", "AVX-512 BF16")):
        check = getattr(torch.cpu, name, None)
        try:
            if check is not None and check():
                return what
        except Exception:  # a private API: its failure must not stop an actor from starting
            continue
    return ""
