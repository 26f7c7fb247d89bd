"""atomic.py: a reader sees the old copy or the new one, and no crash loses the last complete copy."""

from __future__ import annotations

import os

import pytest

from areal_lite.kit.trainer.rundir import latest_checkpoint
from areal_lite.kit.trainer.train import save_checkpoint
from areal_lite.utils import atomic
from areal_lite.utils.atomic import atomic_dir, atomic_file, recover_dir, recover_dirs


def write(name: str, text: str):
    def fill(tmp: str) -> None:
        with open(os.path.join(tmp, name), "w") as f:
            f.write(text)

    return fill


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def test_atomic_dir_creates_then_replaces(tmp_path):
    final = tmp_path / "a" / "v1"
    assert atomic_dir(str(final), write("x", "old")) == str(final)
    atomic_dir(str(final), write("y", "new"))
    assert sorted(os.listdir(final)) == ["y"], "the new copy replaces the old one whole"
    assert sorted(os.listdir(final.parent)) == ["v1"], "no temporary or aside folder is left"


def test_a_failing_fill_keeps_the_previous_copy(tmp_path):
    final = tmp_path / "v1"
    atomic_dir(str(final), write("x", "old"))

    def boom(tmp: str) -> None:
        write("x", "half")(tmp)
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_dir(str(final), boom)
    assert read(final / "x") == "old"
    assert os.listdir(tmp_path) == ["v1"]


def test_a_crash_between_the_renames_loses_nothing(tmp_path, monkeypatch):
    """The old copy is renamed aside, then the process dies before the new one is renamed in."""
    final = tmp_path / "step_000003"
    atomic_dir(str(final), write("x", "old"))
    real_rename, calls = os.rename, []

    def dying_rename(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:  # the rename that would put the new copy in place
            raise KeyboardInterrupt("killed")
        real_rename(src, dst)

    monkeypatch.setattr(atomic.os, "rename", dying_rename)
    with pytest.raises(KeyboardInterrupt):
        atomic_dir(str(final), write("x", "new"))
    monkeypatch.setattr(atomic.os, "rename", real_rename)
    assert not final.exists(), "the crash happened with the old copy aside"
    assert any(n.startswith(".old-step_000003-") for n in os.listdir(tmp_path)), "...but still on disk"
    recover_dirs(str(tmp_path))
    assert read(final / "x") == "old", "the next reader puts the previous copy back"
    atomic_dir(str(final), write("x", "new"))
    assert read(final / "x") == "new"


def test_recover_dir_drops_asides_when_the_new_copy_landed(tmp_path):
    final = tmp_path / "v2"
    atomic_dir(str(final), write("x", "new"))
    (tmp_path / ".old-v2-abc123").mkdir()  # the crash came after both renames, before the aside was deleted
    recover_dir(str(final))
    assert os.listdir(tmp_path) == ["v2"] and read(final / "x") == "new"


def test_atomic_file(tmp_path):
    path = tmp_path / "d" / "rows.jsonl"

    def fill(text):
        def f(tmp):
            with open(tmp, "w") as fh:
                fh.write(text)

        return f

    atomic_file(str(path), fill("one"), suffix=".jsonl")
    with pytest.raises(ValueError):
        atomic_file(str(path), lambda tmp: (_ for _ in ()).throw(ValueError("bad row")))
    assert read(path) == "one" and os.listdir(path.parent) == ["rows.jsonl"]


class _Loader:
    def state_dict(self) -> dict:
        return {"position": 7}


class _Actor:
    """Writes a checkpoint the way FSDPPPOActor.save does (a folder), or fails half way."""

    def __init__(self, text: str, fail: bool = False):
        self.text, self.fail = text, fail

    def save(self, path: str) -> None:
        os.makedirs(path)
        write("weights", self.text)(path)
        if self.fail:
            raise OSError("no space left on device")


def test_resaving_a_checkpoint_that_fails_keeps_the_previous_one(tmp_path):
    """The trainer used to delete step_<k> before renaming the new copy in: a crash there lost the checkpoint."""
    root = str(tmp_path / "checkpoints")
    first = save_checkpoint(root, 5, _Actor("v1"), _Loader(), keep_last=2)
    with pytest.raises(OSError):
        save_checkpoint(root, 5, _Actor("v2", fail=True), _Loader(), keep_last=2)
    assert latest_checkpoint(root) == first
    assert read(os.path.join(first, "actor", "weights")) == "v1"
    save_checkpoint(root, 6, _Actor("v3"), _Loader(), keep_last=1)
    assert os.listdir(root) == ["step_000006"], "keep_last prunes older steps"
