"""What a benchmark's results file records about where it ran: the machine (CPU model, cores, vector ISA: the package's
own `areal_lite.utils.machine`, re-exported here) and the source tree's commit."""

from __future__ import annotations

import subprocess

from areal_lite.utils.machine import cpu_model, describe, vector_isa

__all__ = ["cpu_model", "describe", "git_state", "vector_isa"]


def git_state(tree: str) -> dict:
    """{"commit": HEAD of `tree`, "dirty": whether tracked files differ from it} ("" and False without git)."""

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", tree, *args], capture_output=True, text=True).stdout.strip()
        except OSError:
            return ""

    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
