"""What a benchmark's results file records about where it ran: the machine (CPU model, cores, vector ISA: the package's
own `areal_lite.utils.machine`, and its `cpu_id`: the family/model/stepping numbers and cache), the ISA switches
set in its environment, and the source tree's commit.

An AVX2 proxy: `AVX2_PROXY_ENV` holds each library's own switch to its AVX2 kernels (torch's kernels, MKL's matmuls,
oneDNN's packed linears: the server's decode runs on all three). Set together on an AVX-512 CPU, they run a bench on
the code an AVX2-only CPU runs, with the Xeon's memory, caches and clocks: a first look, not that CPU's figures.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

from areal_lite.utils.machine import cpu_id, cpu_model, vector_isa
from areal_lite.utils.machine import describe as _describe

__all__ = [
    "AVX2_PROXY_ENV",
    "cpu_id",
    "cpu_model",
    "describe",
    "forced_isa",
    "git_state",
    "vector_isa",
    "write_json",
    "write_results",
]

AVX2_PROXY_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def forced_isa() -> str:
    """The ISA switches of `AVX2_PROXY_ENV` set here, e.g. "ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2"; "" if
    none (the CPU runs its own best kernels)."""
    return " ".join(f"{k}={os.environ[k]}" for k in AVX2_PROXY_ENV if os.environ.get(k))


def describe() -> dict:
    """{"cpu_model", "cores", "vector_isa"} (`areal_lite.utils.machine.describe`: under the proxy "AVX2", the CPU's
    bf16 units being oneDNN's, which ONEDNN_MAX_CPU_ISA switches off), "cpu_id" (`cpu_id`) and "forced_isa"
    (`forced_isa`)."""
    return {**_describe(), "cpu_id": cpu_id(), "forced_isa": forced_isa()}


# What the benches write: a change there is a result, not a change to the code measured.
RESULT_PATHS = (":(exclude)bench/results", ":(exclude)bench/RESULTS.md")


def git_state(tree: str) -> dict:
    """{"commit": HEAD of `tree`, "dirty": whether tracked files other than the results (`RESULT_PATHS`) differ from
    it} ("" and False without git): a run of several benches replaces results files as it goes."""

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", tree, *args], capture_output=True, text=True).stdout.strip()
        except OSError:
            return ""

    dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", *RESULT_PATHS)
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(dirty)}


def write_results(path: str, bench: str, args, tree: str, **figures) -> dict:
    """Write a bench's results file at `path` ("" writes nothing): its name, `args` (argparse's), the date, the
    commit of `tree` (`git_state`), the machine (`describe`), then `figures`. Returns the record."""
    record = {"bench": bench, "args": vars(args), "date": time.strftime("%Y-%m-%d %H:%M:%S"), **git_state(tree),
              **describe(), **figures}  # fmt: skip
    if path:
        write_json(path, record)
    return record


def write_json(path: str, record: dict) -> None:
    """`record` as indented JSON at `path`, its folder made if missing; written aside and moved into place, so an
    interrupted write never leaves half a results file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, path)
