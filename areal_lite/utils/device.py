"""Where torch runs and with how many threads.

Design decisions: `pick_device("auto")` takes CUDA, else MPS, else the CPU, and an explicit name that is not
available is an error rather than a silent fallback. On a 2-core laptop the server and the trainer share the cores,
so threads per process go through one rule, `capped_threads` (the config's count, capped by `OMP_NUM_THREADS`).
"""

from __future__ import annotations

import os

import torch

__all__ = ["capped_threads", "set_torch_threads", "pick_device"]


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
