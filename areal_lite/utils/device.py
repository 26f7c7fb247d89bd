"""Where torch runs and with how many threads.

Design decisions: `pick_device("auto")` takes CUDA, else the CPU, and an explicit name that is not available is an
error rather than a silent fallback; Apple's MPS is refused, never picked (`DEVICE_CHOICES` says why). On a 2-core
laptop the server and the trainer share the cores, so threads per process go through one rule, `capped_threads`
(the config's count, capped by `OMP_NUM_THREADS`). `cpu_native_bf16` says whether this CPU computes bfloat16 in
hardware (AVX-512 BF16 or AMX): without it, bf16 matmuls are emulated and slower than float32. Having the
instructions is not enough either (`cpu_bf16_speedup` measures), so the actor only autocasts to bf16 where it
measured that it pays. On Linux the trainer and the embedded server keep freed memory for reuse
(`keep_freed_memory`) rather than page-faulting it back every step, and give weights that still point into their
checkpoint file memory of their own (`own_file_backed`). Setting the threads also settles MKL's choice of kernel for
each vector-math function on one thread first (`warm_vector_math`): a first call on two threads can compute wrong.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import re
import statistics
import sys
import time
from typing import Callable

import torch

__all__ = [
    "BF16_MIN_SPEEDUP",
    "DEVICE_CHOICES",
    "KEEP_FREED_TUNABLES",
    "capped_threads",
    "cpu_bf16_speedup",
    "cpu_native_bf16",
    "speedup_on_one_thread",
    "keep_freed_memory",
    "file_mappings",
    "in_file_mapping",
    "is_device_name",
    "own_file_backed",
    "set_torch_threads",
    "warm_vector_math",
    "pick_device",
]

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
_TRIM_THRESHOLD = 1 << 30  # what `keep_freed_memory` sets (with no mmap for large blocks)
# The same settings for a process started with them (GLIBC_TUNABLES), e.g. TRL's in bench/vs_trl.py.
KEEP_FREED_TUNABLES = f"glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold={_TRIM_THRESHOLD}"
_kept = False


def capped_threads(n: int) -> int:
    """`n` threads capped by `OMP_NUM_THREADS` when that is set (`n <= 0`, torch's default, stays as it is).

    Configs ask for threads per process (a trainer that takes turns with its server may use both cores of a laptop);
    the environment variable is the machine-wide say. `make test` sets it to 1 because it runs two notebooks at once
    on two cores, where a second OpenMP thread only spin-waits for a descheduled sibling (many times slower).
    Both the trainer (`set_torch_threads`) and the launcher of a server process go through this one rule.
    """
    cap = os.environ.get("OMP_NUM_THREADS", "").strip()
    if n > 0 and cap.isdigit() and int(cap) > 0:
        return min(n, int(cap))
    return n


def set_torch_threads(n: int) -> int:
    """`torch.set_num_threads(capped_threads(n))`; returns the count in effect (`n <= 0` leaves torch's default).
    Runs `warm_vector_math` first: every process that computes sets its threads here before its first forward."""
    warm_vector_math()
    n = capped_threads(n)
    if n > 0:
        torch.set_num_threads(n)
    return torch.get_num_threads()


# ATen's float32/float64 unary ops that call MKL's vector math (VML) on each thread's chunk (ATen/cpu/vml.h)
_VML_OPS = ("acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp", "log", "log10", "log2", "sin", "sqrt",
            "tan", "tanh", "trunc")  # fmt: skip
_vml_warm = False


def warm_vector_math() -> None:
    """Call each of ATen's MKL vector-math functions once on one element, in float32 and float64 (once per process).

    Why: oneMKL picks a VML function's kernel on its first call, and when that first call runs on two OpenMP threads
    at once one of them may compute its whole chunk with a low-accuracy kernel (pytorch/pytorch#188792). On a
    2-core Intel Xeon that struck the embedded server's first prefill in some of its starts: the RoPE table (`cos`)
    of the second thread's rows was off in the fourth digit, so the same seed gave other log-probs and, steps later,
    other rewards. A one-element call runs on the calling thread alone and settles the choice; it costs microseconds.
    """
    global _vml_warm
    if _vml_warm:
        return
    for dtype in (torch.float32, torch.float64):
        one = torch.full((1,), 0.5, dtype=dtype)
        for name in _VML_OPS:
            getattr(torch, name)(one)
    _vml_warm = True


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep the memory torch frees for its next allocations (Linux; once per process).

    Why: glibc serves every block over 32 MB with its own mmap and unmaps it when freed, so the next allocation of
    the same size page-faults all of it back in. A PPO update of SmolLM2-135M allocates such blocks by the gigabyte
    (the logits over the 49k-token vocabulary, their log-softmax and gradients), and the faults cost a large share
    of an update's time, more on a virtual machine that hands freed pages back to its host (bench/update_speed.py
    times the update). So, as jemalloc or tcmalloc would: no mmap for large blocks (`M_MMAP_MAX` 0), and the
    heap's free top goes back to the OS only past 1 GiB (`M_TRIM_THRESHOLD`). The price is resident memory that
    stays at its peak. Returns whether the setting took effect (False on other C libraries and systems).
    """
    global _kept
    if _kept:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    _kept = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    return _kept


# What a config's `device` and `pick_device` take (the config check and pick_device's errors say it). Not Apple's
# MPS: it has no float64, which sampling and the loss sums use, and no test runs on it; on Apple Silicon: the CPU.
DEVICE_CHOICES = "auto, cpu, cuda or cuda:N (on Apple Silicon: cpu; MPS lacks the float64 the kit uses)"


def is_device_name(value: object) -> bool:
    """Whether `value` is one of DEVICE_CHOICES (None: a config section that is not there)."""
    return value is None or re.fullmatch(r"auto|cpu|cuda(:\d+)?", str(value).strip().lower()) is not None


def pick_device(preferred: str = "auto") -> torch.device:
    """ "auto" -> cuda, else cpu. Explicit names are honoured, with a clear error if unavailable; mps is refused."""
    preferred = (preferred or "auto").strip().lower()
    if preferred == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not is_device_name(preferred):
        raise ValueError(f"device {preferred!r} is not one the kit runs on: use {DEVICE_CHOICES}")
    device = torch.device(preferred)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {preferred!r} requested but CUDA is not available; use 'auto' or 'cpu'")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise RuntimeError(f"device {preferred!r} requested but only {torch.cuda.device_count()} CUDA device(s)")
    return device


def cpu_native_bf16() -> str:
    """This CPU's native bfloat16 instructions, "AMX" or "AVX-512 BF16", or "" when it has neither or oneDNN may not
    use them (`ONEDNN_MAX_CPU_ISA` below its bf16 kernels: the AVX2 proxy of bench/_machine.py).

    torch 2.x exposes the checks as private `torch.cpu._is_amx_tile_supported` / `_is_avx512_bf16_supported`
    (`torch.backends.cpu.get_cpu_capability()` only names the vector width, "AVX512" with or without BF16); a torch
    without them, or one whose check fails, counts as "no", the safe answer (float32 is never the slow choice).
    """
    try:  # oneDNN capped below its bf16 kernels (ONEDNN_MAX_CPU_ISA=AVX2, say) leaves the units unused
        if torch.backends.mkldnn.is_available() and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return ""
    except Exception:
        pass
    for name, what in (("_is_amx_tile_supported", "AMX"), ("_is_avx512_bf16_supported", "AVX-512 BF16")):
        check = getattr(torch.cpu, name, None)
        try:
            if check is not None and check():
                return what
        except Exception:  # a private API: its failure must not stop an actor from starting
            continue
    return ""


# bf16 is taken (by the actor's precision plan, by the server's `dtype=auto`) only where it measured at least this much
# faster: CPUs tend to land far on either side of 1, and the margin keeps a noisy measurement from choosing a path
# that is no faster.
BF16_MIN_SPEEDUP = 1.2


def cpu_bf16_speedup(rows: int = 512, width: int = 1024, repeats: int = 3) -> float:
    """How many times as fast a linear layer's forward and backward run under bf16 autocast as in float32, on this
    CPU: a [rows, width] input through a [2 * width, width] weight (`speedup_on_one_thread`, a fraction of a second).
    Measured once per process, so that the actors of one process (an actor and its reference model) agree.

    Why measure rather than trust the instructions: having AVX-512 BF16 does not make bf16 fast. On some CPUs
    oneDNN's bf16 kernels run a PPO update much slower than float32, on others much faster
    (bench/update_speed.py measures the whole update both ways).
    """
    return _bf16_speedup(rows, width, repeats)


@functools.lru_cache(maxsize=None)
def _bf16_speedup(rows: int, width: int, repeats: int) -> float:
    g = torch.Generator().manual_seed(0)  # its own generator: the caller's random stream is left as it was
    x = torch.randn(rows, width, generator=g, requires_grad=True)
    w = torch.randn(2 * width, width, generator=g, requires_grad=True)

    def step(bf16: bool) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            y = torch.nn.functional.linear(x, w)
        y.float().sum().backward()
        x.grad = w.grad = None

    return speedup_on_one_thread(lambda: step(False), lambda: step(True), repeats)


def speedup_on_one_thread(base: Callable[[], object], other: Callable[[], object], repeats: int = 3) -> float:
    """How many times as fast `other` runs as `base`: the median CPU seconds of each, taken in turns `repeats` times
    after two warm-up calls each (first calls pay kernel set-up), on one torch thread and timed by that thread's CPU
    clock. Why not wall time on every thread: the trainer and its server start at the same time, and on a busy
    2-core machine wall time measures the other process (an OpenMP team waits for a core that is elsewhere): a bf16
    matmul three times as fast can then read as no faster."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:

        def seconds(fn: Callable[[], object]) -> float:
            t = time.thread_time()
            fn()
            return time.thread_time() - t

        for _ in range(2):
            seconds(base), seconds(other)
        times: tuple[list[float], list[float]] = ([], [])
        for _ in range(repeats):
            times[0].append(seconds(base))
            times[1].append(seconds(other))
        return statistics.median(times[0]) / max(statistics.median(times[1]), 1e-9)
    finally:
        torch.set_num_threads(saved)


def file_mappings() -> list[tuple[int, int]]:
    """Address ranges of this process's file mappings (/proc/self/maps; none where it is missing)."""
    ranges = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 6 and fields[5].startswith("/"):
                    lo, hi = (int(x, 16) for x in fields[0].split("-"))
                    ranges.append((lo, hi))
    except OSError:
        pass
    return ranges


def in_file_mapping(t: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    """Whether `t`'s storage lies in one of `ranges` (`file_mappings()`, read once for many tensors)."""
    ptr = t.untyped_storage().data_ptr()
    return t.device.type == "cpu" and any(lo <= ptr < hi for lo, hi in ranges)


def own_file_backed(model: torch.nn.Module) -> None:
    """Copy the CPU parameters and buffers of `model` that point into a file mapping into memory of their own.

    Why: `from_pretrained` maps a safetensors file privately and, where no conversion is needed (float32 on a CPU),
    the parameters are views of that mapping. The first write to them (an optimizer step in the trainer, a weight
    update in the server) then faults and copies each 4 KB page, which makes the first update several times slower
    than the next ones. And as long as any tensor points into the mapping, the file stays resident beside the
    copies the server fuses (the model's size again in RSS). Copied once at load into memory that can use huge
    pages, they cost nothing later.
    `.data` is swapped in place, so tied weights stay tied; tensors that are the model's own already (a GPU, a
    converted dtype, the server's fused matrices) are not copied."""
    mapped = file_mappings()
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if in_file_mapping(t, mapped):
                t.data = t.data.clone()
