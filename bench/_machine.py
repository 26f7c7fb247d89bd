"""What a benchmark's results file records about where it ran: the CPU model and the source tree's commit."""

from __future__ import annotations

import platform
import subprocess


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


def git_state(tree: str) -> dict:
    """{"commit": HEAD of `tree`, "dirty": whether tracked files differ from it} ("" and False without git)."""

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", tree, *args], capture_output=True, text=True).stdout.strip()
        except OSError:
            return ""

    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
