"""Loading the model: once at startup, and again from a safetensors folder on /update_weights_from_disk.

Design decisions
- An update checks everything before it changes anything: names, shapes and completeness of the incoming tensors
  are verified first, so a bad folder answers an error and leaves the live model serving the old weights.
- Tensors are copied into the existing parameters (`copy_`), never swapped: the model object, its device and any
  tied weights (lm_head = embed_tokens, saved once by `save_pretrained`) stay as they are.
- Weight versions count up as SGLang's do when none is given: "default" -> "1" -> "2" ...
- `ServedWeights` names what is served (version, merged LoRA adapter) and holds the one update that waits; the
  scheduler only decides when it may run (between batches, or at once while paused).
"""

from __future__ import annotations

import concurrent.futures
import glob
import logging
import os
import time
from typing import Any, Optional

import torch

from areal_lite.kit.server.lora import LoraAdapters
from areal_lite.kit.server.protocol import (
    DEFAULT_WEIGHT_VERSION,
    LoraUpdate,
    WeightUpdate,
    lora_update_result,
    weight_update_result,
)

log = logging.getLogger("areal_lite.kit.server")  # one logger for the server


# AREAL_LITE_SERVER_TRANSFORMERS=1: load through transformers even where the lean load applies (a comparison, a
# suspected difference)
TRANSFORMERS_ENV = "AREAL_LITE_SERVER_TRANSFORMERS"


def load_model(model_path: str, device: str, dtype: str, lean: bool = True) -> tuple[Any, Any, str]:
    """Load tokenizer + model (aliases resolved by utils.model_store). Returns (model, tokenizer, path).

    `lean` (the fast path's): a checkpoint `lean.lean_files` accepts loads without transformers, seconds sooner
    (bench/server_start.py); any other, `lean=False` or `AREAL_LITE_SERVER_TRANSFORMERS=1`, through transformers."""
    from areal_lite.kit.server.lean import lean_files, load_lean
    from areal_lite.utils.device import pick_device
    from areal_lite.utils.model_store import resolve_model_path

    path = resolve_model_path(model_path)
    if (os.path.isabs(path) or path.startswith((".", "~"))) and not os.path.isdir(os.path.expanduser(path)):
        raise FileNotFoundError(f"model folder {path} does not exist")
    torch_device = pick_device(device)
    if dtype == "auto":
        torch_dtype = auto_dtype(path, torch_device)
    else:
        torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    if os.environ.get(TRANSFORMERS_ENV) == "1":
        why_not: Optional[str] = f"{TRANSFORMERS_ENV}=1"
    elif not lean:
        why_not = "the model's own forward was asked for (--no-fast-path)"
    else:
        why_not = lean_files(path) if os.path.isdir(path) else "a hub id"
    if why_not is None:
        model, tokenizer = load_lean(path, torch_dtype, torch_device)
        log.info("loaded without transformers (kit/server/lean.py)")
        return model, tokenizer, path
    log.info("loading through transformers (%s)", why_not)
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(torch_device).eval()
    model.requires_grad_(False)
    return model, tokenizer, path


def auto_dtype(path: str, device: torch.device) -> torch.dtype:
    """What `--dtype auto` serves the model in folder `path` on `device` (`precision.serving_dtype`), logged."""
    from areal_lite.kit.server.lean import model_json
    from areal_lite.kit.server.precision import serving_dtype

    try:
        cfg = model_json(os.path.join(path, "config.json"))
    except OSError:  # a hub id: transformers resolves it
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(path).to_dict()
    hidden = int(cfg.get("hidden_size") or 1024)  # the MLP's sizes; a generic pair for other models
    dtype, why = serving_dtype(device, hidden, int(cfg.get("intermediate_size") or 4 * hidden))
    log.info("dtype=auto: %s (%s)", str(dtype).replace("torch.", ""), why)
    return dtype


@torch.no_grad()
def copy_weights_from_disk(model: Any, path: str) -> None:
    """Copy the tensors of every `*.safetensors` file in folder `path` into `model`'s parameters. Raises (with the
    model unchanged) when the folder is missing or its tensors do not match the model's."""
    from safetensors.torch import load_file

    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} is not a directory")
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    incoming: dict[str, torch.Tensor] = {}
    for f in files:
        incoming.update(load_file(f))
    params = model.state_dict()
    unknown = sorted(set(incoming) - set(params))
    if unknown:
        raise ValueError(f"unexpected tensors {unknown[:5]}")
    for name, t in incoming.items():
        if tuple(t.shape) != tuple(params[name].shape):
            raise ValueError(f"{name}: shape {tuple(t.shape)} != model's {tuple(params[name].shape)}")
    loaded_ptrs = {params[n].data_ptr() for n in incoming}
    missing = [n for n, p in params.items() if n not in incoming and p.data_ptr() not in loaded_ptrs]
    if missing:  # tied weights (lm_head = embed_tokens) are saved once; anything else missing is an error
        raise ValueError(f"missing tensors {missing[:5]}")
    for name, t in incoming.items():
        params[name].copy_(t.to(params[name].device))


def update_weights_from_disk(model: Any, request: WeightUpdate, current_version: str) -> str:
    """Load `request.model_path` into `model` (see `copy_weights_from_disk`); returns the new weight version: the
    request's, or the one after `current_version` when it names none."""
    t0 = time.perf_counter()
    copy_weights_from_disk(model, request.model_path)
    given = request.weight_version
    version = next_weight_version(current_version) if given is None else given
    dt = time.perf_counter() - t0
    log.info("weights updated from %s in %.2fs (version %s -> %s)", request.model_path, dt, current_version, version)
    return version


def next_weight_version(current: str) -> str:
    """The version after `current` when an update names none: "default" -> "1" -> "2" ..."""
    return str(int(current) + 1) if current.lstrip("-").isdigit() else "1"


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """EOS ids from the generation config, the model config and the tokenizer (ChatML: <|im_end|>)."""
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


class ServedWeights:
    """The weights a server serves and their name: the version its responses carry, the LoRA adapter merged into
    them (`lora.py`), and the one update (`WeightUpdate` or `LoraUpdate`) waiting to be applied. Used on the
    scheduler thread only; the scheduler decides when `apply` may run."""

    def __init__(self, model: Any, model_path: str):
        self.model = model
        self.model_path = model_path  # the folder the weights came from last
        self.version = DEFAULT_WEIGHT_VERSION
        self.lora = LoraAdapters(model)  # the active LoRA adapter, merged into the weights
        self._base_version = self.version  # the weights' version under the adapter
        self.pending: Optional[tuple[Any, concurrent.futures.Future]] = None

    def request(self, request: Any, fut: concurrent.futures.Future) -> Optional[dict]:
        """Hold `request` until `apply`, whose result resolves `fut`; returns the refusal (a response body) when
        another update is already waiting, else None."""
        if self.pending is not None:
            if isinstance(request, LoraUpdate):
                return lora_update_result(False, "another weight update is in progress", self.lora.loaded())
            return weight_update_result(False, "another weight update is in progress")
        self.pending = (request, fut)
        return None

    def apply(self, runner: Any) -> bool:
        """Apply the pending update, re-derive what `runner` keeps of the weights (a packed copy) and resolve the
        update's future with its response body. Returns whether the weights changed (a failed update changes
        nothing: everything is checked first)."""
        assert self.pending is not None
        request, fut = self.pending
        self.pending = None
        result = self._apply_lora(request) if isinstance(request, LoraUpdate) else self._apply_disk(request)
        if result["success"]:
            with torch.inference_mode():
                runner.refresh()
        fut.set_result(result)
        return result["success"]

    def _apply_disk(self, request: WeightUpdate) -> dict:
        try:
            self.version = update_weights_from_disk(self.model, request, self.version)
        except Exception as e:  # the model is unchanged when loading fails (everything is checked first)
            return weight_update_result(False, f"Failed to update weights: {e}")
        self.lora.forget()  # the base it was merged into is gone
        self._base_version = self.version
        self.model_path = request.model_path
        msg = f"Succeeded to update model weights. Weight version updated to {self.version}."
        return weight_update_result(True, msg)

    def _apply_lora(self, request: LoraUpdate) -> dict:
        """Load (merge) or unload an adapter; a response's weight_version is then the adapter's name (`lora.py`)."""
        try:
            if request.lora_path is None:
                self.lora.unload(request.lora_name)
            else:
                self.lora.load(request.lora_name, request.lora_path)
        except Exception as e:  # checked before anything changed: the model still serves what it served
            verb = "unload" if request.lora_path is None else "load"
            return lora_update_result(False, f"Failed to {verb} LoRA adapter: {e}", self.lora.loaded())
        self.version = self.lora.active or self._base_version
        return lora_update_result(True, "", self.lora.loaded())
