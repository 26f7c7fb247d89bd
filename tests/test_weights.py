"""areal_lite.engine.fsdp_utils.weights: version folders, pruning, clean-up, NCCL metadata, checkpoints.

The actor's use of them (loadable folders, FSDP, the gloo broadcast, a save/load round trip) is checked in
test_actor.py; here each piece on its own, with a small model and no actor.
"""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch
from safetensors.torch import load_file

from areal_lite.api.io_struct import WeightUpdateMeta
from areal_lite.engine.fsdp_utils import weights
from areal_lite.utils.safetensors_io import save_tensors


def _write(text: str):
    def fill(tmp: str) -> None:
        with open(os.path.join(tmp, "f.txt"), "w") as f:
            f.write(text)

    return fill


def _read(d: str) -> str:
    with open(os.path.join(d, "f.txt")) as f:
        return f.read()


def test_versions_are_swapped_in_pruned_and_removed_on_close(tmp_path):
    meta = WeightUpdateMeta.from_disk(path=str(tmp_path / "w"), keep_last=2)
    root = os.path.dirname(meta.dir_for(1))
    os.makedirs(root)
    (tmp_path / "w" / "notes.txt").write_text("mine")
    os.makedirs(os.path.join(root, "weight_update_vx"))  # not a version: never pruned
    pub = weights.WeightPublisher()
    for v in range(1, 4):
        assert pub.write_version(meta.dir_for(v), v, meta.keep_last, _write(f"v{v}")) == meta.dir_for(v)
    assert sorted(os.listdir(root)) == ["notes.txt", "weight_update_v2", "weight_update_v3", "weight_update_vx"]
    # Rewriting a version replaces it whole; a failed rewrite leaves the previous copy.
    pub.write_version(meta.dir_for(3), 3, meta.keep_last, _write("v3 again"))
    assert _read(meta.dir_for(3)) == "v3 again"

    def broken(tmp: str) -> None:
        _write("half")(tmp)
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        pub.write_version(meta.dir_for(3), 3, meta.keep_last, broken)
    assert _read(meta.dir_for(3)) == "v3 again"
    assert not [n for n in os.listdir(root) if n.startswith(".")]  # no temporary folder left behind
    pub.close()
    pub.close()  # idempotent
    assert sorted(os.listdir(root)) == ["notes.txt", "weight_update_vx"]  # only what it wrote is gone


def test_a_version_recycles_the_file_of_the_version_it_prunes(tmp_path):
    """With `reuse`, version k's file is the one version k - keep_last held, overwritten in place (the same inode:
    the file system keeps its pages); a failed write drops that old version rather than leave it without its file."""
    meta = WeightUpdateMeta.from_disk(path=str(tmp_path / "w"), keep_last=2)
    pub = weights.WeightPublisher()
    name = weights.MODEL_FILE

    def fill(value: float):
        return lambda tmp: save_tensors({"w": torch.full((256,), value)}, os.path.join(tmp, name))

    inodes = {}
    for v in range(1, 5):
        pub.write_version(meta.dir_for(v), v, meta.keep_last, fill(float(v)), reuse=name)
        inodes[v] = os.stat(os.path.join(meta.dir_for(v), name)).st_ino
    assert inodes[3] == inodes[1] and inodes[4] == inodes[2] and inodes[1] != inodes[2]
    for v in (3, 4):
        assert torch.equal(load_file(os.path.join(meta.dir_for(v), name))["w"], torch.full((256,), float(v)))
    assert not os.path.exists(meta.dir_for(2))

    def broken(tmp: str) -> None:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        pub.write_version(meta.dir_for(5), 5, meta.keep_last, broken, reuse=name)
    assert not os.path.exists(meta.dir_for(3)) and not os.path.exists(meta.dir_for(5))  # the donor is gone, whole
    assert torch.equal(load_file(os.path.join(meta.dir_for(4), name))["w"], torch.full((256,), 4.0))
    # Without `reuse` (an adapter) every version is a new file.
    pub.write_version(meta.dir_for(6), 6, meta.keep_last, fill(6.0))
    assert os.stat(os.path.join(meta.dir_for(6), name)).st_ino != inodes[4]
    pub.close()


def test_remove_weight_dirs_removes_a_parent_left_empty(tmp_path):
    dirs = [str(tmp_path / "w" / "weight_update_v1")]
    os.makedirs(dirs[0])
    weights.remove_weight_dirs(dirs)
    assert not (tmp_path / "w").exists() and dirs == []


def test_nccl_meta_sets_only_declared_fields():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1, bias=False))
    meta = WeightUpdateMeta.from_nccl("127.0.0.1", 1234)
    before = set(vars(meta))
    specs = weights.weight_update_specs(model)
    assert [s["name"] for s in specs] == ["0.weight", "0.bias", "1.weight"]
    assert weights.fill_nccl_meta(meta, specs, n_server_gpus=2) is meta
    assert set(vars(meta)) == before == {f.name for f in dataclasses.fields(WeightUpdateMeta)}
    assert meta.shapes == [[2, 3], [2], [1, 2]] and meta.dtypes == ["float32"] * 3 and meta.nccl_world_size == 3
    if not torch.cuda.is_available():
        with pytest.raises(NotImplementedError, match="from_disk"):
            weights.require_cuda(torch.device("cpu"))


def test_checkpoint_round_trip_restores_weights_optimizer_schedule_and_rngs(tiny_model_path, tmp_path):
    from transformers import AutoModelForCausalLM

    def fresh():
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
        return model, opt, sched

    model, opt, sched = fresh()
    model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    sched.step()
    state = weights.full_state_dict(model, world=1)
    path = str(tmp_path / "ckpt")
    write = lambda d: weights.write_hf_folder(model, state, d, tiny_model_path)  # noqa: E731
    weights.save_checkpoint(path, write, weights.full_optimizer_state(model, opt), sched, version=5)
    assert sorted(os.listdir(path)) == ["actor_state.pt", "model"]
    assert any(n.startswith("tokenizer") for n in os.listdir(os.path.join(path, "model")))
    torch.manual_seed(7)
    random.seed(7)
    draws = (torch.rand(2), random.random())
    torch.manual_seed(7)
    random.seed(7)
    weights.save_checkpoint(path, write, weights.full_optimizer_state(model, opt), sched, version=5)  # overwrite

    other, opt2, sched2 = fresh()
    torch.manual_seed(0)
    random.seed(0)
    assert weights.load_checkpoint(path, other, opt2, sched2) == 5
    assert (torch.rand(2).tolist(), random.random()) == (draws[0].tolist(), draws[1])
    for (n, p), q in zip(model.named_parameters(), other.parameters()):
        torch.testing.assert_close(q, p, atol=0, rtol=0, msg=n)
    assert sched2.get_last_lr() == sched.get_last_lr()
    assert opt2.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    with pytest.raises(FileNotFoundError, match="not an actor checkpoint"):
        weights.load_checkpoint(str(tmp_path), other, opt2, sched2)
