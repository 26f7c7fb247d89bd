"""Tie a helper process's life to another process's: it exits when that process is gone, however it died.

    ident = process_identity(os.getpid())          # in the owner (the trainer), passed to its helpers
    exit_when_gone(ident)                          # in a helper: a thread exits this process when the owner dies
    set_parent_death_signal(signal.SIGKILL)        # in a helper: the kernel kills it when its parent dies (Linux)

Design decisions
- The owner may die by SIGKILL (the OOM killer), where none of its own code runs, so the helper must notice by
  itself. Two kernel mechanisms cover it on Linux: `PR_SET_PDEATHSIG` (a signal when the *parent* dies; it is tied
  to the parent *thread* that forked the child, so only use it where that thread lives as long as the process) and
  a pidfd (`os.pidfd_open`), which becomes readable the moment the watched process ends, whoever its parent is.
  A reward worker is forked by multiprocessing's forkserver, not by the trainer, so it needs the pidfd watch; the
  PDEATHSIG covers the forkserver itself dying. Where pidfds are missing the watch polls once a second.
- A process is named by its pid *and* its start time (`/proc/<pid>/stat` field 22), since pids are reused: a
  helper started after its owner died must not adopt a stranger with the same pid. The identity is checked after
  the pidfd is opened, so the pidfd provably refers to the owner (a live process keeps its pid).
- The helper leaves with `os._exit`: nobody is left to report to, and a cleanup that hangs would be the orphan.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading
import time
from typing import Callable, Optional, Tuple

__all__ = ["pid_alive", "process_identity", "exit_when_gone", "set_parent_death_signal", "prctl_function"]

PR_SET_PDEATHSIG = 1
Identity = Tuple[int, Optional[int]]


def _start_time(pid: int) -> Optional[int]:
    """Clock ticks since boot at which `pid` started (Linux), or None where /proc is missing or the pid is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: count fields after its closing one.
    return int(stat[stat.rindex(b")") + 2 :].split()[19])


def process_identity(pid: int) -> Identity:
    """(pid, start time): what `exit_when_gone` needs to recognise this very process later."""
    return pid, _start_time(pid)


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists (possibly another user's)."""
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else


def _same_process(ident: Identity) -> bool:
    pid, started = ident
    if started is not None:
        return _start_time(pid) == started
    return pid_alive(pid)


def exit_when_gone(ident: Identity, interval: float = 1.0) -> threading.Thread:
    """Exit this process (status 0, no cleanup) as soon as the process `ident` ends; returns the watching thread."""
    pid = ident[0]
    pidfd = None
    if hasattr(os, "pidfd_open"):
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            pidfd = None  # already gone (checked below), or a kernel without pidfds (polled)
    if not _same_process(ident):
        os._exit(0)

    def wait_pidfd() -> None:
        select.select([pidfd], [], [])  # readable once the process has ended
        os._exit(0)

    def poll() -> None:
        while _same_process(ident):
            time.sleep(interval)
        os._exit(0)

    thread = threading.Thread(target=poll if pidfd is None else wait_pidfd, name="areal-lite-lifeline", daemon=True)
    thread.start()
    return thread


def prctl_function() -> Optional[Callable[..., int]]:
    """libc's prctl on Linux, else None. Resolve it before forking: no dlopen in a freshly forked child."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` to this process when its parent (thread) dies; False where unsupported."""
    prctl = prctl_function()
    return prctl is not None and prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
