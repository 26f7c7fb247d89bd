"""Write a file or a folder so that readers see the old copy or the new one, never half of either.

One rule for every writer in the kit (weight versions, checkpoints, prepared models, prepared data):
- Build the new copy in a temporary sibling (same folder, hence same file system, so a rename is atomic).
- A file is put in place with `os.replace`, atomic on POSIX and Windows.
- A folder cannot be replaced by a rename on every OS, so the old copy is first *renamed aside* (to
  `.old-<name>-*`), the new one renamed in, and only then the old one deleted. A crash between the two renames
  leaves the previous copy on disk under the aside name; the next writer or reader of that path puts it back
  (`recover_dir`), so no crash ever loses a complete copy.
- On failure the temporary copy is removed and the exception propagates; the previous copy is untouched.
Locking against concurrent writers is the caller's job (see `utils/model_store.py`, `dataset/common.py`): this
module only makes a single writer crash-safe.
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
from typing import Callable

__all__ = ["atomic_dir", "atomic_file", "recover_dir", "recover_dirs"]


def _aside_pattern(final: str) -> str:
    return os.path.join(os.path.dirname(final), f".old-{os.path.basename(final)}-*")


def recover_dir(final: str) -> None:
    """If a crash left `final` missing but its previous copy renamed aside, put that copy back."""
    final = os.path.abspath(final)
    asides = sorted(glob.glob(_aside_pattern(final)), key=os.path.getmtime)
    if not asides:
        return
    if not os.path.exists(final):
        os.rename(asides.pop(), final)  # the newest aside copy is the last complete one
    for stale in asides:
        shutil.rmtree(stale, ignore_errors=True)


def recover_dirs(parent: str) -> None:
    """`recover_dir` for every folder of `parent` that a crashed writer left renamed aside (before listing it)."""
    if not os.path.isdir(parent):
        return
    for name in os.listdir(parent):
        if name.startswith(".old-"):
            # mkdtemp's random suffix has no "-", so the last "-" ends the original name.
            recover_dir(os.path.join(parent, name[len(".old-") :].rsplit("-", 1)[0]))


def atomic_dir(final: str, fill: Callable[[str], None]) -> str:
    """Build folder `final` with `fill(tmp_dir)` and swap it into place, replacing any previous copy.

    Returns `final`. Leftover temporary folders of earlier crashed writers are removed first.
    """
    final = os.path.abspath(final)
    parent, base = os.path.dirname(final), os.path.basename(final)
    os.makedirs(parent, exist_ok=True)
    recover_dir(final)
    for stale in glob.glob(os.path.join(parent, f".tmp-{base}-*")):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = tempfile.mkdtemp(prefix=f".tmp-{base}-", dir=parent)
    try:
        fill(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not os.path.exists(final):
        os.rename(tmp, final)
        return final
    aside = tempfile.mkdtemp(prefix=f".old-{base}-", dir=parent)
    os.rmdir(aside)  # only the unique name is wanted: rename needs the target to be absent (or an empty dir)
    os.rename(final, aside)
    os.rename(tmp, final)
    shutil.rmtree(aside, ignore_errors=True)
    return final


def atomic_file(path: str, fill: Callable[[str], None], suffix: str = "") -> str:
    """Write file `path` with `fill(tmp_path)` and `os.replace` it into place. Returns `path`."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{os.path.basename(path)}-", suffix=suffix, dir=parent)
    os.close(fd)
    try:
        fill(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path
