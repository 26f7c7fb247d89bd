"""Folder locks that the kernel drops when their holder dies: how a live run tells its folders from a dead run's.

    fd = try_lock_folder(path)      # an fd holding an exclusive lock on folder `path`, or None if another holds it
    fd = lock_folder(path)          # the same, created if missing, waiting while another holds it
    os.close(fd)                    # releases it (so does the holder's death, SIGKILL included)

Design decisions
- `flock` on the folder's own file descriptor: no lock files to leave behind, no pid files (pids are reused), no
  clocks. A lock belongs to an open file description, so another open of the same folder, in this process too,
  does not share it. The descriptors are close-on-exec: a server started by the run does not inherit the lock.
- `lock_folder` checks that the folder it locked is still the one at that path (same inode) and retries if not:
  whoever removes an empty folder does so while holding its lock, so a waiter then holds a lock on a removed folder.
"""

from __future__ import annotations

import errno
import fcntl
import os
from typing import Optional

__all__ = ["try_lock_folder", "lock_folder"]


def _open_dir(path: str) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def try_lock_folder(path: str) -> Optional[int]:
    """An fd holding an exclusive lock on the existing folder `path`, or None if another open holds it (or the
    folder is gone)."""
    try:
        fd = _open_dir(path)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        raise


def lock_folder(path: str) -> int:
    """An fd holding an exclusive lock on folder `path` (created if missing); blocks while another holds it."""
    while True:
        try:
            os.makedirs(path, exist_ok=True)
            fd = _open_dir(path)
        except FileNotFoundError:
            continue  # a parent was removed while we created it: try again
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # we locked a folder that was removed meanwhile
