"""Weight publishing and actor checkpoints: how new weights leave the trainer, and how a run is saved and restored.

Design decisions, and why
- Disk route: version k is a complete Hugging Face folder (`write_hf_folder`), so a server loads it with
  `from_pretrained` and nothing else. It is built aside and swapped into place (`atomic.atomic_dir`): a server
  polling for the folder never loads half of it. Versions older than `meta.keep_last` are pruned: each is a full
  copy of the weights, often in RAM under /dev/shm.
- Recycled pages: a new version overwrites the model file of the oldest version it replaces, in place
  (`WeightPublisher.write_version`), so the file system keeps its pages rather than free and allocate them each step.
- Version folders are transport, not checkpoints: `WeightPublisher` removes the ones it wrote on `close()` or at
  exit. A run's default folder is claimed by the process (`utils.weight_dirs`); a later run removes what a killed
  one left.
- Tied weights (an LM head sharing the embedding) are written once, under the embedding's name: transformers
  re-ties them on load, and safetensors refuses two names for one storage.
- NCCL route (GPU + SGLang): trainer rank 0 joins a group with the servers (`init_custom_process_group`, as SGLang
  and AReaL build it) and broadcasts every parameter in order (`broadcast_params`); the meta says what to receive.
- Checkpoints: `<path>/model` (loadable; a LoRA actor's adapter alone) and `<path>/actor_state.pt` (optimizer, LR
  schedule, version, RNG states, so a resumed run continues exactly), swapped into place as one folder.
- Ranks: gathering a full state is a collective every rank calls; writing files is rank 0's. Nothing here
  synchronises: the caller (`FSDPPPOActor`) adds the barriers.
"""

from __future__ import annotations

import os
import random
import shutil
import weakref
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional

import torch

from areal_lite.api.io_struct import WeightUpdateMeta
from areal_lite.utils.atomic import atomic_dir
from areal_lite.utils.safetensors_io import save_tensors

__all__ = [
    "MODEL_FILE",
    "TOKENIZER_PREFIXES",
    "recycled_file",
    "WeightPublisher",
    "init_custom_process_group",
    "remove_weight_dirs",
    "prune_versions",
    "versions_before",
    "full_state_dict",
    "full_optimizer_state",
    "write_hf_folder",
    "weight_update_specs",
    "fill_nccl_meta",
    "require_cuda",
    "broadcast_params",
    "save_checkpoint",
    "load_checkpoint",
]

# Files besides the weights that make a weight folder a complete, loadable model folder.
TOKENIZER_PREFIXES = ("tokenizer", "vocab", "merges", "special_tokens_map", "added_tokens", "chat_template")
MODEL_FILE = "model.safetensors"  # the weights of a full-model folder
VERSION_PREFIX = "weight_update_v"  # `io_struct.weight_dir`'s naming (AReaL's)
ACTOR_STATE = "actor_state.pt"


def recycled_file(use_lora: bool) -> Optional[str]:
    """The file a new weight version writes over in place, taken from the version it prunes (`write_version`'s
    `reuse`): the full model's; none for an adapter (small: nothing worth recycling)."""
    return None if use_lora else MODEL_FILE


# ----------------------------------------------------------------------------------------------------------------
# Disk versions


def remove_weight_dirs(dirs: List[str]) -> None:
    """Remove the weight versions in `dirs`, then each parent folder left empty (never anything else), unless this
    process holds it as its claimed weight folder (`utils.weight_dirs`: it goes at exit, and stays locked until)."""
    from areal_lite.utils.weight_dirs import is_claimed

    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    for root in {os.path.dirname(d) for d in dirs}:
        if is_claimed(root):
            continue
        try:
            os.rmdir(root)
        except OSError:
            pass  # not empty (someone else's files) or already gone
    dirs.clear()


def versions_before(root: str, keep_from: int) -> List[str]:
    """The version folders `weight_update_v<k>` of `root` with k < keep_from, oldest first."""
    found = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        number = name[len(VERSION_PREFIX) :]
        if name.startswith(VERSION_PREFIX) and number.isdigit() and int(number) < keep_from:
            found.append((int(number), os.path.join(root, name)))
    return [path for _, path in sorted(found)]


def prune_versions(root: str, keep_from: int) -> None:
    """Remove the version folders `weight_update_v<k>` of `root` with k < keep_from (nothing else)."""
    for path in versions_before(root, keep_from):
        shutil.rmtree(path, ignore_errors=True)


def full_state_dict(model: torch.nn.Module, world: int) -> Dict[str, torch.Tensor]:
    """Full (unsharded) model state on CPU. A collective under FSDP (`world` > 1): every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if world > 1:
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def write_hf_folder(model: torch.nn.Module, state: Dict[str, torch.Tensor], out_dir: str, tokenizer_dir: str) -> None:
    """safetensors + config + generation config + the tokenizer files of `tokenizer_dir`: a folder
    `from_pretrained` loads. A `MODEL_FILE` already in `out_dir` (a recycled one) is overwritten in place."""
    tied = getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or {}
    if isinstance(tied, dict) and getattr(model.config, "tie_word_embeddings", False):
        drop = set(tied)
    else:
        drop = set()
    tensors = {k: v for k, v in state.items() if k not in drop}
    save_tensors(tensors, os.path.join(out_dir, MODEL_FILE), metadata={"format": "pt"})
    model.config.save_pretrained(out_dir)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out_dir)
    if tokenizer_dir and os.path.isdir(tokenizer_dir):
        for name in os.listdir(tokenizer_dir):
            if name.startswith(TOKENIZER_PREFIXES):
                src = os.path.join(tokenizer_dir, name)
                if os.path.isfile(src):
                    shutil.copy2(src, os.path.join(out_dir, name))


# ----------------------------------------------------------------------------------------------------------------
# NCCL broadcast


def init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str):
    """A process group with processes outside the default world (the SGLang servers), as SGLang/AReaL build it."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = timedelta(minutes=30)
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), store, group_name=group_name, timeout=timeout
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def weight_update_specs(model: torch.nn.Module) -> List[Dict[str, Any]]:
    """names, dtypes, shapes in broadcast order (what /update_weights_from_distributed expects)."""
    return [
        {"name": n, "dtype": str(p.dtype).replace("torch.", ""), "shape": list(p.shape)}
        for n, p in model.named_parameters()
    ]


def fill_nccl_meta(meta: WeightUpdateMeta, specs: List[Dict[str, Any]], n_server_gpus: int) -> WeightUpdateMeta:
    """Put the specs and the group size (1 trainer + the servers' GPUs) on `meta`, in place; returns it."""
    meta.names = [s["name"] for s in specs]
    meta.dtypes = [s["dtype"] for s in specs]
    meta.shapes = [s["shape"] for s in specs]
    meta.nccl_world_size = 1 + int(n_server_gpus)
    return meta


def require_cuda(device: torch.device) -> None:
    """The NCCL route needs the model on a CUDA GPU; say which route works instead. (The tests exercise the group
    and the broadcast with gloo in place of NCCL.)"""
    if not torch.cuda.is_available() or device.type != "cuda":
        raise NotImplementedError(
            "NCCL weight updates need CUDA GPUs and SGLang servers; on this machine use "
            "WeightUpdateMeta.from_disk(path=...) (the embedded CPU server loads weights from disk)"
        )


def broadcast_params(model: torch.nn.Module, group: Any, send: bool) -> None:
    """Broadcast every parameter, in `weight_update_specs()` order, over `group` from its rank 0 if `send`.

    Under FSDP2 every trainer rank must call this (gathering a full parameter is a collective); only the rank that
    owns the group (trainer rank 0) passes `send=True`.
    """
    import torch.distributed as tdist

    for _, param in model.named_parameters():
        tensor = param.data.full_tensor() if hasattr(param.data, "full_tensor") else param.data
        if send:
            tdist.broadcast(tensor.contiguous(), src=0, group=group)


class WeightPublisher:
    """What one trainer has published: the version folders it wrote, and the NCCL group it opened (rank 0)."""

    def __init__(self) -> None:
        self.dirs: List[str] = []
        # A finalizer rather than __del__: it also runs at interpreter exit, and it holds the list, not self.
        self._cleanup = weakref.finalize(self, remove_weight_dirs, self.dirs)
        self.nccl_group = None

    def write_version(
        self, final: str, version: int, keep_last: int, fill: Callable[[str], None], reuse: Optional[str] = None
    ) -> str:
        """Build version `version`'s folder `final` with `fill(tmp_dir)`, swap it into place, and remove the versions
        beside it older than the last `keep_last`. Returns the folder's absolute path.

        `reuse` names a file that `fill` overwrites in place when it finds it (`MODEL_FILE`: `write_hf_folder`): the
        oldest version this call removes gives its copy to the new folder first ("Recycled pages", module docstring):
        moved into the new folder and overwritten in place, the file keeps the same pages instead of freeing a full
        copy of the weights and allocating one again each step (a fresh file in /dev/shm is slow to write, and the
        time varies step to step; bench/vs_trl.py reports the weight_sync phase). A version this replaces is one
        `keep_last` says is no longer read, and rewriting a version (after a resume) never loses the previous copy.
        """
        final = os.path.abspath(final)
        keep_from = version - max(1, int(keep_last)) + 1
        donors = versions_before(os.path.dirname(final), keep_from) if reuse else []
        donor = next((d for d in donors if d != final and os.path.isfile(os.path.join(d, reuse))), None)

        def fill_reusing(tmp: str) -> None:
            if donor is None:
                return fill(tmp)
            os.replace(os.path.join(donor, reuse), os.path.join(tmp, reuse))
            try:
                fill(tmp)
            except BaseException:
                shutil.rmtree(donor, ignore_errors=True)  # lost its file: drop it now, as pruning would have
                raise

        final = atomic_dir(final, fill_reusing)
        self.dirs.append(final)
        prune_versions(os.path.dirname(final), keep_from=keep_from)
        return final

    def nccl_group_for(self, meta: WeightUpdateMeta):
        """The group shared with the servers, opened on the first call (the servers join it at the same time)."""
        if self.nccl_group is None:
            self.nccl_group = init_custom_process_group(
                "nccl",
                f"tcp://{meta.nccl_master_address}:{meta.nccl_master_port}",
                world_size=int(meta.nccl_world_size or 2),  # 1 trainer + the servers' GPUs
                rank=0,
                group_name=meta.nccl_group_name,
            )
        return self.nccl_group

    def close(self) -> None:
        """Remove the version folders written so far (idempotent)."""
        self._cleanup()


# ----------------------------------------------------------------------------------------------------------------
# Checkpoints


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """Full optimizer state on CPU, keyed by parameter name. A collective under FSDP: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(model, optimizer, options=opts)


def save_checkpoint(
    path: str,
    write_model: Callable[[str], None],
    optim_state: Optional[Dict[str, Any]],
    lr_scheduler: Any,
    version: int,
) -> str:
    """Write `<path>/model` with `write_model(dir)` and `<path>/actor_state.pt`, swapped into place as one folder.

    The RNG states (torch, CUDA, Python) are taken now, so a resumed run draws the same numbers as an uninterrupted
    one. An actor without an optimizer (`optimizer=None`) saves None for its state and schedule. Rank 0 only.
    """
    extra = {
        "optimizer": optim_state,
        "lr_scheduler": None if lr_scheduler is None else lr_scheduler.state_dict(),
        "version": version,
        "rng": {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "python": random.getstate(),
        },
    }

    def fill(tmp: str) -> None:
        os.makedirs(os.path.join(tmp, "model"))
        write_model(os.path.join(tmp, "model"))
        torch.save(extra, os.path.join(tmp, ACTOR_STATE))

    return atomic_dir(path, fill)


def load_checkpoint(
    path: str,
    model: torch.nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    lr_scheduler: Any,
    load_weights: Optional[Callable[[str], None]] = None,
) -> int:
    """Restore what `save_checkpoint` wrote into model, optimizer, schedule and the RNGs; returns the version.

    `load_weights(<path>/model)` replaces the loading of a full `model.safetensors` (a LoRA actor loads its adapter).
    """
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model_file = os.path.join(path, "model", "model.safetensors")
    state_file = os.path.join(path, ACTOR_STATE)
    for f in (state_file,) if load_weights is not None else (model_file, state_file):
        if not os.path.isfile(f):
            raise FileNotFoundError(f"{path} is not an actor checkpoint: {f} is missing")
    extra = torch.load(state_file, map_location="cpu", weights_only=False)
    if load_weights is not None:
        load_weights(os.path.join(path, "model"))
    else:
        opts = StateDictOptions(full_state_dict=True, strict=False)  # tied weights were written once (see above)
        result = set_model_state_dict(model, load_file(model_file), options=opts)
        tied = set(getattr(model, "all_tied_weights_keys", None) or {})
        missing = [k for k in (getattr(result, "missing_keys", None) or []) if k not in tied]
        if missing:
            raise RuntimeError(f"checkpoint {path} lacks weights {missing[:5]}")
    if optimizer is not None:  # an actor without one (AReaL's optimizer=None) restores the weights alone
        if extra["optimizer"] is None:
            raise RuntimeError(f"checkpoint {path} has no optimizer state: an actor without an optimizer saved it")
        set_optimizer_state_dict(model, optimizer, extra["optimizer"], options=StateDictOptions(full_state_dict=True))
        lr_scheduler.load_state_dict(extra["lr_scheduler"])
    rng = extra["rng"]
    torch.set_rng_state(rng["torch"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    random.setstate(rng["python"])
    return int(extra["version"])
