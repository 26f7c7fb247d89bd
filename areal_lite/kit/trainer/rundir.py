"""A run's folder, `<fileroot>/<experiment>/<trial>`: whose run it holds, whether a start continues it, and never
two runs mixed in it.

    run = open_run_dir(config, resume=False, existing="refuse")   # raises RunDirError on a folder it must not use
    run.resume, run.checkpoint, run.state, run.run_id             # continue from this checkpoint (or step 0)
    run.close()                                                   # at the end of the run (unlocks the folder)

Design decisions
- Identity: a fresh run writes `run.json` (a random `run_id`, the names, the start time), and every checkpoint
  records that `run_id` (`trainer_state.pt`). Resuming refuses a checkpoint of another run, and work without a
  `run.json` (nothing says whose run it is).
- When to continue (AReaL 1.0.4's `recover.mode`, decided as `areal.utils.recover.check_if_recover` does): 'on' and
  'auto' continue when the folder holds this run's `run.json` and its work (checkpoints or statistics); 'off' and
  'disabled' never do. `--resume` (`resume=True`) is 'on'. A continued run without a checkpoint restarts at step 0.
- Never a mix: a fresh start on a folder holding a run's work refuses with a message naming `--resume`
  (`existing="refuse"`, the command line), or moves to the next free trial folder `<trial>-2`, ... and says so
  (`existing="new_trial"`, `train()` from a notebook, where running a cell again means "run it again"). Old runs'
  files are never deleted or rewritten; a folder with `run.json` but no work is simply reused.
- One live run per folder: the run holds a lock on it (`utils.flock`) until `close()` or its death, so a second
  start on a folder in use refuses (or, with `new_trial`, moves on) instead of interleaving two logs.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch

from areal_lite.utils.atomic import atomic_file, recover_dirs
from areal_lite.utils.flock import try_lock_folder

__all__ = ["RunDirError", "RunDir", "open_run_dir", "latest_checkpoint", "RUN_INFO", "TRAINER_STATE"]

RUN_INFO = "run.json"
TRAINER_STATE = "trainer_state.pt"  # a checkpoint's step, data position, RNG, run_id and settings
EXISTING = ("refuse", "new_trial")


class RunDirError(RuntimeError):
    """The run folder cannot be used as asked; the message says what to do instead."""


@dataclass
class RunDir:
    """An open run folder: `resume` says whether this start continues the run `run_id` (from `checkpoint`, or
    from step 0 when it has none yet); `state` is that checkpoint's `TRAINER_STATE`, read once."""

    path: str
    run_id: str
    resume: bool
    checkpoint: Optional[str] = None
    state: Optional[dict] = None
    _fd: Optional[int] = field(default=None, repr=False)

    def close(self) -> None:
        """Unlock the folder (idempotent); the process's death does the same."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def latest_checkpoint(ckpt_root: str) -> Optional[str]:
    """The newest complete `step_<n>` checkpoint folder under `ckpt_root`, or None."""
    if not os.path.isdir(ckpt_root):
        return None
    recover_dirs(ckpt_root)  # a crash while re-saving a step left its previous copy renamed aside
    done = [
        d
        for d in os.listdir(ckpt_root)
        if d.startswith("step_") and os.path.isfile(os.path.join(ckpt_root, d, TRAINER_STATE))
    ]
    return os.path.join(ckpt_root, max(done, key=lambda d: int(d[5:]))) if done else None


def read_checkpoint_file(ckpt: str, name: str) -> Any:
    """`torch.load` of one file of a checkpoint; a damaged file is a RunDirError naming the folder to remove."""
    try:
        return torch.load(os.path.join(ckpt, name), weights_only=False)
    except Exception as e:  # a truncated or missing file: torch's own message names neither the folder nor the fix
        raise RunDirError(damaged(ckpt, e)) from None


def damaged(ckpt: str, error: BaseException) -> str:
    return (f"checkpoint {ckpt} cannot be read ({type(error).__name__}: {str(error)[:200]}); remove that folder "
            "to resume from the checkpoint before it")  # fmt: skip


def check_writable(folder: str, key: str) -> None:
    """Refuse to start (`RunDirError`, one line naming the config key) when `folder` cannot be made or written."""
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:  # a file in the way, read-only, ...
        raise RunDirError(
            f"{folder} cannot be written ({e.strerror or e}); set {key}= to a folder you can write"
        ) from None


def _read_info(path: str) -> Optional[dict]:
    try:
        with open(os.path.join(path, RUN_INFO), encoding="utf-8") as fh:
            info = json.load(fh)
        return info if isinstance(info, dict) and info.get("run_id") else None
    except (OSError, ValueError):
        return None


def _work(path: str) -> List[str]:
    """What of a run's work `path` holds: a non-empty stats.jsonl, checkpoint folders (empty list: none)."""
    found = []
    stats = os.path.join(path, "stats.jsonl")
    if os.path.isfile(stats) and os.path.getsize(stats) > 0:
        found.append("stats.jsonl")
    ckpt_root = os.path.join(path, "checkpoints")
    if os.path.isdir(ckpt_root):
        steps = sorted(d for d in os.listdir(ckpt_root) if d.startswith("step_"))
        if steps:
            found.append(f"checkpoints/{steps[-1]}")
    return found


def _write_info(path: str, config: Any) -> str:
    run_id = uuid.uuid4().hex
    info = {
        "run_id": run_id,
        "experiment_name": config.experiment_name,
        "trial_name": config.trial_name,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "pid": os.getpid(),
    }

    def fill(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(info, fh, indent=2)

    atomic_file(os.path.join(path, RUN_INFO), fill)
    return run_id


def _refusal(path: str, work: List[str], config: Any) -> RunDirError:
    return RunDirError(
        f"{path} already holds a run ({', '.join(work)}): continue it with --resume (or recover.mode=auto), "
        f"or start fresh with another trial_name= (e.g. trial_name={config.trial_name}-2) or after removing {path}"
    )


def _decide(config: Any, path: str, recover: bool, fd: int) -> Optional[RunDir]:
    """The locked folder `path`: continue its run, or start fresh in it; None if it holds another run's work."""
    info, work = _read_info(path), _work(path)
    if recover and info is not None and work:
        ckpt = latest_checkpoint(os.path.join(path, "checkpoints"))
        state = read_checkpoint_file(ckpt, TRAINER_STATE) if ckpt is not None else None
        if state is not None and state.get("run_id") != info["run_id"]:
            raise RunDirError(
                f"{ckpt} was not written by the run recorded in {os.path.join(path, RUN_INFO)} "
                f"(run_id {info['run_id']}): refusing to continue another run's checkpoint; remove {path} or "
                "choose another trial_name= to start fresh"
            )
        return RunDir(path, info["run_id"], resume=True, checkpoint=ckpt, state=state, _fd=fd)
    if recover and work:
        raise RunDirError(
            f"{path} holds {', '.join(work)} but no {RUN_INFO} (written by an older areal-lite?), so nothing says "
            f"whose run it is: remove {path} or choose another trial_name= to start fresh"
        )
    if work:
        return None
    return RunDir(path, _write_info(path, config), resume=False, _fd=fd)


def open_run_dir(config: Any, resume: bool = False, existing: str = "refuse") -> RunDir:
    """Open (and lock) the run folder of `config` for a run that continues it or starts fresh; see the module
    docstring. `resume=True` is recover mode 'on'; `existing` says what a fresh start does on a used folder."""
    if existing not in EXISTING:
        raise ValueError(f"existing must be one of {EXISTING}, got {existing!r}")
    recover = resume or config.recover.mode in ("on", "auto")
    trial = config.trial_name
    for n in range(1, 1000):
        name = trial if n == 1 else f"{trial}-{n}"
        path = os.path.join(config.fileroot, config.experiment_name, name)
        if existing == "new_trial" and n > 1 and (_work(path) or _read_info(path)):
            continue  # a used folder: the old run stays as it is
        check_writable(path, "fileroot")
        fd = try_lock_folder(path)
        if fd is None:
            if existing == "refuse" or recover:
                raise RunDirError(f"{path} is in use by a live run; wait for it to end or choose another trial_name=")
            continue
        try:
            run = _decide(config, path, recover, fd)
        except BaseException:
            os.close(fd)
            raise
        if run is not None:
            if n > 1:
                print(f"train: {os.path.dirname(path)}/{trial} holds an earlier run; this run goes to {path}")
                config.trial_name = name
            return run
        os.close(fd)
        if existing == "refuse" or recover:
            raise _refusal(path, _work(path), config)
    raise RunDirError(f"no free trial folder for {trial} under {os.path.join(config.fileroot, config.experiment_name)}")
