"""LoRA adapters on the embedded server: SGLang's `/load_lora_adapter` and `/unload_lora_adapter`, served merged.

Design decisions
- One active adapter at a time, merged into the weights: loading adapter `name` sets every adapted matrix to
  W = W_base + scale * B @ A and leaves every other weight as it was; loading another replaces it. Decoding then
  costs exactly what the base model costs, and the fused fast path (`fastpath.py`) serves it unchanged: the merge
  `copy_`s into the parameters, which are views of the runner's fused matrices, and the runner re-packs after it.
  SGLang serves many adapters side by side in one batch; a trainer needs one at a time, since the client pauses,
  loads version k and sends every later request with `lora_path = <lora_name>-v<k>` (AReaL's naming).
- W_base is kept as a copy of each adapted matrix, so a merge never accumulates the previous adapter's rounding
  (subtracting the old B @ A would). The price is one extra copy of the adapted weights.
- A request's `lora_path` must name the active adapter (any other name is a 400 naming the loaded one); a request
  without one is served with the active adapter, unlike SGLang, where it gets the base model.
  `meta_info.weight_version` of a response is the adapter's name while one is loaded.
- Everything is checked before anything changes (`read_adapter`): a bad adapter answers 400 and the model keeps
  serving what it served. A full weight update (`/update_weights_from_disk`) replaces the base and drops the adapter.
- Loads and unloads are weight updates for the scheduler: they wait until the running batch drained or the server
  is paused, and run on the scheduler thread (`Scheduler._maybe_apply_update`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from typing import Any, Optional

import torch

from areal_lite.utils.weight_dirs import ADAPTER_CONFIG, ADAPTER_WEIGHTS  # the file names the trainer writes

log = logging.getLogger("areal_lite.kit.server")  # one logger for the server
# peft's key of one LoRA matrix: base_model.model.<module>.lora_A.weight (older peft: .lora_A.default.weight)
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


def _read_config(path: str) -> float:
    """The adapter's scale (alpha / r, or alpha / sqrt(r) for rsLoRA) after checking what the merge supports."""
    cfg_file = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(f"{path} holds no {ADAPTER_CONFIG}")
    try:
        with open(cfg_file) as f:
            cfg = json.load(f)
    except ValueError as e:  # json's own message names no file
        raise ValueError(f"{cfg_file} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_file}: expected a JSON object")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"{cfg_file}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for key in ("use_dora", "fan_in_fan_out", "modules_to_save", "rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise ValueError(f"{cfg_file}: {key}={cfg[key]!r} is not supported (only plain A/B pairs are merged)")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise ValueError(f"{cfg_file}: r must be a positive integer, got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise ValueError(f"{cfg_file}: lora_alpha must be a number, got {alpha!r}")
    return alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r


def read_adapter(model: Any, path: str) -> dict[str, tuple[float, torch.Tensor, torch.Tensor]]:
    """The update of every adapted matrix, {parameter name: (scale, B, A)} in float32; raises on any mismatch.

    Adapters that would need more than a merged A/B pair (DoRA, `modules_to_save`, per-module rank or alpha patterns,
    Conv1D `fan_in_fan_out`, embedding LoRA) are refused, all before anything changes."""
    from safetensors.torch import load_file

    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} is not a directory")
    scale = _read_config(path)
    weights = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(weights):
        raise FileNotFoundError(f"{path} holds no {ADAPTER_WEIGHTS}")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in load_file(weights).items():
        m = _KEY.match(key)
        if m is None:
            raise ValueError(f"unexpected tensor {key!r} (only lora_A/lora_B weights are merged)")
        pairs.setdefault(m["module"], {})[m["ab"]] = t
    if not pairs:
        raise ValueError(f"{weights} holds no LoRA tensors")
    params = dict(model.named_parameters())
    deltas = {}
    for module, ab in pairs.items():
        name = f"{module}.weight"
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{module}: lora_A and lora_B must both be present")
        if name not in params or params[name].dim() != 2:
            raise ValueError(f"the adapter targets {module!r}, which is not a linear layer of this model")
        a, b = ab["A"].float(), ab["B"].float()
        out_f, in_f = params[name].shape
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_f or b.shape[0] != out_f or a.shape[0] != b.shape[1]:
            raise ValueError(
                f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit its weight {(out_f, in_f)}"
            )
        deltas[name] = (scale, b, a)
    return deltas


def _rows(p: torch.Tensor) -> torch.Tensor:
    """`p`, or its transpose where that one is row-major (the fast path's weights are transposed views); the base
    copies are kept in this layout, so saving and restoring them copies rows."""
    return p.t() if p.dim() == 2 and p.stride(0) == 1 and p.stride(1) != 1 else p


class LoraAdapters:
    """The active adapter of one model and the base copies of the matrices it changed (scheduler thread only)."""

    def __init__(self, model: Any):
        self.model = model
        self.active: Optional[str] = None
        self.active_path = ""
        self._base: dict[str, torch.Tensor] = {}

    def loaded(self) -> dict[str, str]:
        """SGLang's `loaded_adapters`: {name: path} (at most one here)."""
        return {self.active: self.active_path} if self.active else {}

    def check_request(self, lora_path: Optional[str]) -> Optional[str]:
        """The error message for a request naming `lora_path`, or None when it may run."""
        if lora_path is None or lora_path == self.active:
            return None
        have = f"the loaded adapter is {self.active!r}" if self.active else "no adapter is loaded"
        return f"lora_path {lora_path!r} is not a loaded LoRA adapter ({have}; POST /load_lora_adapter first)"

    @torch.no_grad()
    def load(self, name: str, path: str) -> None:
        """Merge adapter `name` from folder `path`, replacing the active one (see the module docstring): the
        matrices only the old one adapted go back to W_base, whose copies are taken the first time an adapter
        touches a matrix."""
        t0 = time.perf_counter()
        deltas = read_adapter(self.model, path)  # raises before anything changes
        params = dict(self.model.named_parameters())
        for pname in [n for n in self._base if n not in deltas]:
            _rows(params[pname]).copy_(self._base.pop(pname))
        for pname, (scale, b, a) in deltas.items():
            # W = W_base + scale * B @ A, written in place by one addmm. The fast path's weights are column blocks
            # of transposed matrices: working on the transpose (`p.t()`, row-major) keeps every write a row write
            # and spares a [out, in] temporary per matrix.
            p = params[pname]
            t = _rows(p)
            m1, m2 = (a.t(), b.t()) if t is not p else (b, a)  # transposed: W^T = W_base^T + A^T B^T
            m1, m2 = m1.to(t.device), m2.to(t.device)
            base = self._base.setdefault(pname, t.detach().clone(memory_format=torch.contiguous_format))
            if t.dtype == torch.float32:
                t.copy_(base)
                t.addmm_(m1, m2, alpha=scale)
            else:  # a bf16 model: add in float32, round once
                t.copy_(torch.addmm(base.float(), m1, m2, alpha=scale).to(t.dtype))
        previous, self.active, self.active_path = self.active, name, path
        dt = time.perf_counter() - t0
        n = len(deltas)
        log.info("LoRA adapter %s loaded from %s in %.2fs (%d matrices; replaced %s)", name, path, dt, n, previous)

    @torch.no_grad()
    def unload(self, name: str) -> None:
        """Put back the base weights of adapter `name`; a ValueError when it is not the active one."""
        if name != self.active:
            have = f"the loaded adapter is {self.active!r}" if self.active else "no adapter is loaded"
            raise ValueError(f"LoRA adapter {name!r} is not loaded ({have})")
        params = dict(self.model.named_parameters())
        for pname, base in self._base.items():
            _rows(params[pname]).copy_(base)
        self.forget()

    def forget(self) -> None:
        """Drop the adapter without touching the weights (a full weight update has just replaced them)."""
        self._base.clear()
        self.active, self.active_path = None, ""
