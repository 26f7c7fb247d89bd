"""areal_lite.utils.safetensors_io: the files are safetensors files (read back by the real package), and an
existing file is overwritten in place."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from areal_lite.utils.safetensors_io import save_tensors


def _tensors() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(5, 3, generator=g),
        "w_t": torch.randn(3, 5, generator=g).t(),  # not contiguous
        "half": torch.randn(4, generator=g).bfloat16(),
        "f16": torch.randn(3, generator=g).half(),
        "d": torch.randn(2, generator=g).double(),
        "ids": torch.arange(7),
        "i32": torch.arange(3, dtype=torch.int32),
        "i8": torch.tensor([-1, 2], dtype=torch.int8),
        "u8": torch.tensor([250, 3], dtype=torch.uint8),
        "flags": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(3.5),
    }


def _same(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_files_load_with_safetensors_with_every_dtype_shape_and_the_metadata(tmp_path):
    ts = _tensors()
    path = str(tmp_path / "m.safetensors")
    save_tensors(ts, path, metadata={"format": "pt"})
    assert _same(load_file(path), ts)
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert sorted(f.keys()) == sorted(ts)
    # The same tensors through safetensors' own writer read back the same.
    save_file({k: v.contiguous() for k, v in ts.items()}, str(tmp_path / "ref.safetensors"))
    assert _same(load_file(str(tmp_path / "ref.safetensors")), load_file(path))


def test_an_existing_file_is_overwritten_in_place_and_cut_to_length(tmp_path):
    path = str(tmp_path / "m.safetensors")
    save_tensors({"a": torch.ones(1000), "b": torch.zeros(10)}, path)
    inode = os.stat(path).st_ino
    smaller = {"a": torch.full((100,), 2.0)}
    save_tensors(smaller, path)
    assert os.stat(path).st_ino == inode  # the same file, its pages reused
    assert _same(load_file(path), smaller)  # nothing of the longer old content is left
    save_tensors(_tensors(), path)
    assert os.stat(path).st_ino == inode and _same(load_file(path), _tensors())


def test_an_unsupported_dtype_is_refused_before_the_file_is_touched(tmp_path):
    path = tmp_path / "m.safetensors"
    save_tensors({"a": torch.ones(3)}, str(path))
    before = path.read_bytes()
    with pytest.raises(TypeError, match="complex64"):
        save_tensors({"a": torch.ones(3), "c": torch.ones(2, dtype=torch.complex64)}, str(path))
    assert path.read_bytes() == before
