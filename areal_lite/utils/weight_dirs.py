"""Weight-update folders owned by a run, not by a process id: claimed under a lock, removed once their owner is
dead, and checked for room before a run starts.

    path = claim_weight_dir("/dev/shm/areal-lite-me/exp/trial/weights", sweep_root="/dev/shm/areal-lite-me")
    check_room(path, version_bytes("/models/smollm2", "float32") * 3, "3 weight versions")

Design decisions
- Every step writes a full copy of the weights, usually to RAM (/dev/shm), and a killed run cannot remove its
  copies. So a folder is named by the run (`<exp>/<trial>/weights`) and *claimed*: its owner holds an exclusive
  `flock` on it (`utils.flock`) while it lives. The kernel drops the lock when the owner dies, SIGKILL included, so
  "the lock can be taken" means "nobody live uses this folder". A folder whose lock is held is never touched.
- Two live runs with the same names (the English and the Chinese notebook side by side) must not prune each
  other's versions: the second claims the next slot, `weights.1`, `weights.2`, ...
- A claim sweeps first (`sweep_stale`): every slot under `sweep_root` whose lock can be taken is a dead run's and is
  removed, so any later run of this user frees what crashed runs left. Sweeping and claiming happen under a lock on
  the parent folder, so two starting runs never take the same slot or delete one being claimed.
- A claimed slot stays (empty) while its owner lives; at exit the owner removes it and the parents left empty, up
  to `sweep_root`. A forked child does not release its parent's claims.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import struct
import threading
from dataclasses import dataclass
from typing import Dict, List, Optional

from areal_lite.utils.flock import lock_folder, try_lock_folder
from areal_lite.utils.lifeline import pid_alive

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "NoRoomError",
    "written_version_bytes",
    "claim_weight_dir",
    "is_claimed",
    "release_weight_dirs",
    "sweep_stale",
    "check_room",
    "version_bytes",
]

# A LoRA version folder holds peft's two files (SGLang reads the same names). The trainer writes them and the server
# reads them; both take the names from here, so the server imports nothing of the trainer.
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"

_LEGACY = re.compile(r"weights-(\d+)$")  # the former per-process folders


@dataclass
class _Claim:
    path: str
    fd: int
    owner: int  # the pid that claimed it (a forked child must not release it)
    stop_at: str  # parents are removed up to this folder, not including it


_CLAIMS: Dict[str, _Claim] = {}  # base path -> claim
_GUARD = threading.Lock()


def _remove_if_dead(path: str) -> bool:
    """Remove slot `path` if no live process owns it (its lock is free, or its legacy pid is gone: folders of the
    older `weights-<pid>` naming are removed once that pid is gone)."""
    legacy = _LEGACY.match(os.path.basename(path))
    if legacy:
        if pid_alive(int(legacy.group(1))):
            return False
        shutil.rmtree(path, ignore_errors=True)
        return True
    fd = try_lock_folder(path)
    if fd is None:
        return False
    try:
        shutil.rmtree(path, ignore_errors=True)  # under its lock: nobody claims it meanwhile
        return True
    finally:
        os.close(fd)


def _is_slot(name: str, base: str) -> bool:
    numbered = name.startswith(base + ".") and name[len(base) + 1 :].isdigit()
    return name == base or numbered or bool(_LEGACY.match(name))


def _sweep_folder(parent: str, base: str = "weights") -> List[str]:
    """Under `parent`'s lock: remove its dead slots; then `parent` itself if left empty. Returns what was removed."""
    removed: List[str] = []
    fd = lock_folder(parent)
    try:
        for name in sorted(os.listdir(parent)):
            path = os.path.join(parent, name)
            if _is_slot(name, base) and os.path.isdir(path) and _remove_if_dead(path):
                removed.append(path)
        try:
            os.rmdir(parent)  # while locked: a run waiting for this lock sees the inode change and retries
        except OSError:
            pass
    finally:
        os.close(fd)
    return removed


def sweep_stale(root: str) -> List[str]:
    """Remove the weight folders of dead runs under `root` (`<root>/<exp>/<trial>/weights*`); returns them."""
    removed: List[str] = []
    if not os.path.isdir(root):
        return removed
    for exp in sorted(os.listdir(root)):
        exp_dir = os.path.join(root, exp)
        if not os.path.isdir(exp_dir) or os.path.islink(exp_dir):
            continue
        for trial in sorted(os.listdir(exp_dir)):
            trial_dir = os.path.join(exp_dir, trial)
            if os.path.isdir(trial_dir) and not os.path.islink(trial_dir):
                removed += _sweep_folder(trial_dir)
        _rmdir_quietly(exp_dir)
    return removed


def _rmdir_quietly(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass  # not empty (another run's folders), or already gone


def claim_weight_dir(base: str, sweep_root: Optional[str] = None) -> str:
    """Claim the first free slot of `base` (`base`, `base.1`, ...) for this process and return its path.

    Dead runs' slots under `sweep_root` (default: `base`'s folder only) are removed first. Claiming the same `base`
    again in this process returns the slot it already holds.
    """
    base = os.path.abspath(base)
    sweep_root = os.path.abspath(sweep_root) if sweep_root is not None else None
    with _GUARD:
        held = _CLAIMS.get(base)
        if held is not None and held.owner == os.getpid():
            return held.path
        parent, name = os.path.split(base)
        if sweep_root is not None:
            sweep_stale(sweep_root)
        else:
            _sweep_folder(parent, name)
        pfd = lock_folder(parent)
        try:
            for i in range(1_000):
                slot = base if i == 0 else f"{base}.{i}"
                os.makedirs(slot, exist_ok=True)
                fd = try_lock_folder(slot)
                if fd is not None:  # else a live run's slot
                    _CLAIMS[base] = _Claim(slot, fd, os.getpid(), sweep_root or parent)
                    return slot
        finally:
            os.close(pfd)
    raise RuntimeError(f"no free weight folder next to {base}: 1000 live runs use one")


def is_claimed(path: str) -> bool:
    """True if `path` is a slot this process holds (it stays, empty and locked, while we live, so a run that writes
    to it again later finds it still claimed)."""
    path = os.path.abspath(path)
    return any(c.path == path and c.owner == os.getpid() for c in _CLAIMS.values())


@atexit.register
def release_weight_dirs() -> None:
    """Remove this process's slots and the parents they leave empty (up to each claim's sweep root)."""
    with _GUARD:
        mine = [base for base, c in _CLAIMS.items() if c.owner == os.getpid()]
        for base in mine:
            _release(_CLAIMS.pop(base))


def _release(claim: _Claim) -> None:
    parent = os.path.dirname(claim.path)
    pfd = lock_folder(parent)  # no run claims a slot here meanwhile
    try:
        shutil.rmtree(claim.path, ignore_errors=True)
        os.close(claim.fd)
        if parent != claim.stop_at:
            _rmdir_quietly(parent)
    finally:
        os.close(pfd)
    up = os.path.dirname(parent)
    while parent != claim.stop_at and up.startswith(claim.stop_at + os.sep):
        _rmdir_quietly(up)
        parent, up = up, os.path.dirname(up)


# --------------------------------------------------------------------------------------------------- room


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def version_bytes(model_dir: str, dtype: str) -> Optional[int]:
    """Bytes of one weight version of the model in `model_dir` saved as `dtype`: its parameter count (from the
    safetensors headers, no tensor read) times the dtype's size. None when the folder has no safetensors files."""
    if not os.path.isdir(model_dir):
        return None
    files = [os.path.join(model_dir, f) for f in os.listdir(model_dir) if f.endswith(".safetensors")]
    if not files:
        return None
    import json

    count = 0
    for path in files:
        with open(path, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        for key, info in header.items():
            if key != "__metadata__":
                n = 1
                for d in info["shape"]:
                    n *= int(d)
                count += n
    return count * _DTYPE_BYTES.get(str(dtype).replace("torch.", ""), 4)


def written_version_bytes(model_path: str, dtype: str) -> Optional[int]:
    """Bytes of one full weight version an actor of `dtype` writes for `model_path` (float32 for `bfloat16` too:
    float32 master weights under autocast, `fsdp_engine._precision_plan`); None where the model's files are not local
    (a hub id not downloaded yet: its size is unknown before the actor loads it)."""
    from areal_lite.utils.model_store import local_model_dir

    model = local_model_dir(model_path)
    return version_bytes(model, "float32" if dtype == "bfloat16" else dtype) if model else None


def _existing_ancestor(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


class NoRoomError(OSError):
    """Too little free room for a run's weight versions; the message is one line that says how much is needed."""


def check_room(path: str, need: int, what: str) -> None:
    """Raise NoRoomError when the file system holding `path` has less than `need` bytes free."""
    free = shutil.disk_usage(_existing_ancestor(path)).free
    if free < need:
        raise NoRoomError(
            f"{path} has {free / 2**20:.1f} MiB free, but {what} need {need / 2**20:.1f} MiB: free some room "
            "(e.g. old folders in /dev/shm) or set weight_update_dir= to a folder with more",
        )
