"""LoRA in the trainer (AReaL 1.0.4's `actor.use_lora`): wrapping the model with peft, and the adapter files.

Design decisions, and why
- peft does the wrapping, with AReaL's settings: `LoraConfig(r=lora_rank, lora_alpha=lora_alpha, target_modules,
  task_type=CAUSAL_LM, bias="none")`, `autocast_adapter_dtype=False`. An empty `target_modules` (or
  `["all-linear"]`) is peft's "all-linear": every `nn.Linear` of the decoder layers (for Llama/Qwen2: q/k/v/o_proj
  and gate/up/down_proj), never the LM head. peft freezes every base weight, so only the adapter matrices A and B
  require grad, and the optimizer (built from `requires_grad` parameters) holds only them: its state shrinks with
  the trainable count.
- The wrapped model keeps the kit's forward: peft passes the packed-attention keyword arguments (`cu_seq_lens_q`,
  `logits_to_keep`, ...) through to the base model, so the loss and update path do not change.
- What leaves the trainer is the adapter only: `adapter_model.safetensors` (the A/B matrices, keys as peft saves
  them) and `adapter_config.json` (rank, alpha, targets), the folder `PeftModel.from_pretrained` and SGLang's
  `/load_lora_adapter` read. It is written from the state dict, not with `save_pretrained`, so a weight version
  holds exactly those two files (no model card) and a checkpoint and a weight version are the same kind of folder.
- One process only: under FSDP2 the adapter would need its own sharding plan; `use_lora` with WORLD_SIZE > 1 is
  refused with a message rather than trained wrongly.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Dict

import torch

from areal_lite.utils.weight_dirs import ADAPTER_CONFIG, ADAPTER_WEIGHTS  # re-exported: the trainer writes them

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "apply_lora",
    "adapter_state_dict",
    "write_adapter_folder",
    "load_adapter_folder",
    "folder_bytes",
]


def _target_modules(cfg: Any) -> Any:
    """AReaL's rule: empty or ["all-linear"] means peft's "all-linear" (every decoder Linear, not the LM head)."""
    targets = list(cfg.target_modules or [])
    return "all-linear" if not targets or targets == ["all-linear"] else targets


def apply_lora(model: torch.nn.Module, cfg: Any, world: int, verbose: bool) -> torch.nn.Module:
    """`model` wrapped with a fresh LoRA adapter (B = 0, so the wrapped model computes what the base did)."""
    from peft import LoraConfig, TaskType, get_peft_model

    if world > 1:
        raise NotImplementedError("actor.use_lora trains in one process only (no FSDP sharding of adapters yet)")
    if cfg.peft_type != "lora":
        raise ValueError(
            f"actor.peft_type must be 'lora' (AReaL's and the kit's only PEFT method), got {cfg.peft_type!r}"
        )
    if int(cfg.lora_rank) <= 0:
        raise ValueError(f"actor.lora_rank must be positive, got {cfg.lora_rank}")
    lora = LoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=int(cfg.lora_rank),
        lora_alpha=cfg.lora_alpha,
        target_modules=_target_modules(cfg),
        bias="none",
    )
    if getattr(cfg, "gradient_checkpointing", False):
        model.enable_input_require_grads()  # checkpointed blocks need an input that requires grad (base is frozen)
    with warnings.catch_warnings():
        # peft 0.21 calls transformers 5's deprecated `is_gradient_checkpointing`: nothing the user can act on
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        model = get_peft_model(model, lora, autocast_adapter_dtype=False)
    if verbose:
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        targets = model.peft_config["default"].target_modules  # peft resolves "all-linear" to the module names
        targets = [targets] if isinstance(targets, str) else sorted(targets)
        print(
            f"areal-lite: LoRA r={lora.r} alpha={lora.lora_alpha} on {', '.join(targets)}: "
            f"{trainable:,} trainable parameters of {total:,} ({100 * trainable / total:.2f}%)"
        )
    return model


def adapter_state_dict(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The adapter's tensors on CPU, keyed as peft saves them (`base_model.model.<module>.lora_A.weight`, ...)."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(model).items()}


def write_adapter_folder(model: torch.nn.Module, state: Dict[str, torch.Tensor], out_dir: str) -> None:
    """`adapter_model.safetensors` + `adapter_config.json` in `out_dir` (see the module docstring)."""
    from safetensors.torch import save_file

    save_file(state, os.path.join(out_dir, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = model.peft_config["default"]
    if not config.base_model_name_or_path:
        config.base_model_name_or_path = getattr(model.get_base_model().config, "_name_or_path", "") or None
    config.save_pretrained(out_dir)


def load_adapter_folder(model: torch.nn.Module, folder: str) -> None:
    """Load an adapter written by `write_adapter_folder` into the wrapped `model` (the base weights untouched)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    path = os.path.join(folder, ADAPTER_WEIGHTS)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder} holds no LoRA adapter ({ADAPTER_WEIGHTS} is missing)")
    state = load_file(path)
    expected = {k: tuple(v.shape) for k, v in adapter_state_dict(model).items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    if got != expected:
        differ = sorted(k for k in got.keys() | expected.keys() if got.get(k) != expected.get(k))
        raise RuntimeError(
            f"the adapter in {folder} does not match this actor's LoRA (names or shapes differ: {differ[:3]}): "
            "same lora_rank and target_modules?"
        )
    result = set_peft_model_state_dict(model, state)
    unexpected = getattr(result, "unexpected_keys", None) or []
    if unexpected:
        raise RuntimeError(f"the adapter in {folder} has tensors this model lacks: {unexpected[:3]}")


def folder_bytes(folder: str) -> int:
    """Bytes of the files directly in `folder` (what one weight sync wrote)."""
    return sum(e.stat().st_size for e in os.scandir(folder) if e.is_file())
