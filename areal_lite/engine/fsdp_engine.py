"""The PPO/GRPO actor: recompute log-probs, compute advantages, take PPO steps, hand weights to the servers.

Method names follow AReaL's `FSDPPPOActor` (`compute_logp`, `compute_advantages`, `ppo_update`, `train_batch`,
`update_weights`, `save`, `load`, ...), so a notebook cell reads the same in both projects. This module only
orchestrates; each part states its own design: `utils/functional.py` (the formulas), `fsdp_utils/packing.py` (packed
micro-batches, shared prompts), `embedding_grad.py`, `weights.py` (weight versions, NCCL, checkpoints), `lora.py`
(`use_lora`: only the adapter trains, syncs and is saved) and `cpu_linear.py` (the LM head's kernel on a CPU).

Design decisions
- One batch: a right-padded dict of [B, L] tensors, or AReaL's list of trajectories joined into one (normalisation
  pools the whole batch). A key that is read is never rewritten, so calling a method twice gives the same tensors.
- One update path: `ppo_update` (`ppo_n_minibatches` steps with `ppo_loss_fn`) and `train_batch` share one step,
  `_train_rows`, so a loss that a notebook hands to `train_batch` trains through exactly the code `ppo_update` uses.
- The global mean: each micro-batch's loss is weighted by its policy tokens over those of all micro-batches on all
  ranks, summed before any backward, so any split into micro-batches or ranks gives the one-big-batch gradient.
- Less compute, same gradient: "Logits only where the loss needs them" (`_logits_for`), "Shared prompts" (a GRPO
  group's prompt runs once) and "Rows without signal" (`_silent_rows`). bench/update_speed.py measures the update.
- torchrun: FSDP2 per decoder layer; every rank gets the whole batch and takes rows r, r + W, ...
- A non-finite gradient norm skips the step (`skipped = 1`); statistics come from the log-probs, not the loss.
- `dtype="bfloat16"`: float32 weights under bf16 autocast, on a GPU always, on a CPU where faster (`_precision_plan`).
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import time
import warnings
from dataclasses import dataclass, field, fields
from functools import partial
from typing import Any, Callable, Collection, Dict, List, Optional, Sequence, Union

import torch

from areal_lite.api.cli_args import NormConfig, OptimizerConfig, PPOActorConfig
from areal_lite.api.engine_api import TrainEngine
from areal_lite.api.io_struct import FinetuneSpec, WeightUpdateMeta
from areal_lite.engine.fsdp_utils.cpu_linear import use_onednn_head
from areal_lite.engine.fsdp_utils.lora import (
    adapter_state_dict,
    apply_lora,
    folder_bytes,
    load_adapter_folder,
    write_adapter_folder,
)
from areal_lite.engine.fsdp_utils.packing import (
    PACKED_SDPA,
    as_long,
    cast_long,
    join_trajectories,
    pack_rows,
    packed_forward,
    prompt_groups,
    register_packed_sdpa,
    row_prompt,
    share_prompts,
    shared_prefix_forward,
    split_into_microbatches,
    split_trajectories,
)
from areal_lite.engine.fsdp_utils.weights import (
    WeightPublisher,
    broadcast_params,
    fill_nccl_meta,
    full_optimizer_state,
    full_state_dict,
    load_checkpoint,
    recycled_file,
    require_cuda,
    save_checkpoint,
    weight_update_specs,
    write_hf_folder,
)
from areal_lite.utils.device import BF16_MIN_SPEEDUP
from areal_lite.utils.functional import (
    grpo_advantages,
    kl_rewards,
    normalize,
    normalize_turn_returns,
    policy_mask,
    ppo_token_loss,
    scatter_logp_and_entropy,
    scatter_next_token_logp,
    shape_rewards,
)

__all__ = ["FSDPPPOActor", "count_policy_tokens"]

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,  # tests only: the float64 reference checks
}

# AREAL_LITE_CPU_BF16=1 forces bf16 autocast for dtype="bfloat16" on a CPU whatever the hardware, =0 forbids it.
CPU_BF16_ENV = "AREAL_LITE_CPU_BF16"

Batch = Union[Dict[str, torch.Tensor], List[Dict[str, torch.Tensor]]]
# train_batch's callables, as AReaL's: loss_fn(logprobs, entropy, input_data, **kwargs) -> scalar, weight_fn(input_data)
LossFn = Callable[..., torch.Tensor]
WeightFn = Callable[[Dict[str, torch.Tensor]], Any]


def count_policy_tokens(input_data: Dict[str, torch.Tensor]) -> torch.Tensor:
    """`train_batch`'s usual `loss_weight_fn`: the micro-batch's policy tokens (the loss is a mean over them)."""
    return input_data["loss_mask"].count_nonzero()


def _dist():
    """torch.distributed if a default process group is up (torchrun), else None."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


# ----------------------------------------------------------------------------------------------------------------
# Set-up helpers: precision, model, sharding, optimizer, LR schedule


def _precision_plan(dtype: torch.dtype, device: torch.device) -> tuple[torch.dtype, bool, str]:
    """(the weights' dtype, whether forward passes autocast to bf16, the one line to print or "").

    Only `bfloat16` is planned; any other dtype loads as asked. Its weights and optimizer state stay float32 (master
    weights: a bf16 weight has an 8-bit mantissa, so an AdamW step below 1/256 of it, as at the GPU configs' learning
    rate of 1e-6, is rounded away; AReaL keeps float32 master weights too) and every forward pass runs under bf16
    autocast: always on a GPU, on a CPU only where it computes bf16 in hardware (`device.cpu_native_bf16`) and a
    linear layer measured at least `BF16_MIN_SPEEDUP` times as fast in bf16 (`device.cpu_bf16_speedup`;
    bench/update_speed.py times the update): emulated bf16 is slower than float32, and native bf16 is not faster on
    every CPU. Elsewhere the CPU actor trains in float32 and prints one line saying why. `AREAL_LITE_CPU_BF16=1`
    forces the CPU's autocast (tests reach it on any CPU), `=0` forbids it.
    """
    if dtype != torch.bfloat16 or device.type not in ("cpu", "cuda"):
        return dtype, False, ""
    if device.type == "cuda":
        return (
            torch.float32,
            True,
            "areal-lite: actor.dtype=bfloat16 on CUDA: float32 weights and optimizer state, "
            "forward passes under bf16 autocast",
        )
    from areal_lite.utils import device as device_utils  # looked up at call time: tests patch the detector

    env = os.environ.get(CPU_BF16_ENV, "").strip()
    if env not in ("", "0", "1"):
        raise ValueError(f"{CPU_BF16_ENV} must be 1 (force bf16 autocast on CPU), 0 (forbid it) or unset, got {env!r}")
    native = device_utils.cpu_native_bf16()
    head = "areal-lite: actor.dtype=bfloat16"
    autocast = f"{head} on CPU: float32 weights and optimizer state, forward passes under bf16 autocast"
    forces = f"{CPU_BF16_ENV}=1 forces bf16 autocast"
    if env == "0":
        return torch.float32, False, f"{head}: {CPU_BF16_ENV}=0 forbids bf16 autocast on CPU; training in float32"
    if env == "1":
        hardware = f"this CPU has {native}" if native else "no AVX-512 BF16/AMX: slower here"
        return torch.float32, True, f"{autocast} (forced by {CPU_BF16_ENV}=1; {hardware})"
    if not native:
        capability = torch.backends.cpu.get_cpu_capability()
        why = f"this CPU ({capability}) has no AVX-512 BF16/AMX, so bf16 would be slower here; training in float32"
        return torch.float32, False, f"{head}: {why} ({forces})"
    speedup = device_utils.cpu_bf16_speedup()
    dist = _dist()
    if dist is not None:  # every rank must take the same path: the slowest measurement decides
        t = torch.tensor([speedup], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        speedup = float(t)
    measured = f"a linear layer's forward and backward ran {speedup:.2f}x as fast in bf16 as in float32 here"
    if speedup >= BF16_MIN_SPEEDUP:
        return torch.float32, True, f"{autocast} (this CPU has {native}; {measured})"
    return torch.float32, False, f"{head}: this CPU has {native}, but {measured}; training in float32 ({forces})"


def _load_model(path: str, dtype: torch.dtype, device: torch.device, trainable: bool) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from areal_lite.utils.device import own_file_backed

    # A small model loads in well under a second; transformers' "Loading weights" bar would be a stray widget in
    # every notebook cell that builds an actor. Only this call is silenced: the caller's setting is restored.
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    if model.config._attn_implementation == "sdpa":
        # Plain sdpa would build a dense mask over the whole packed row; see packing.py.
        register_packed_sdpa()
        model.set_attn_implementation(PACKED_SDPA)
    model.config.use_cache = False
    model.to(device)
    if trainable:
        own_file_backed(model)  # else the first AdamW step copies-on-write the checkpoint file (utils.device)
        model.train()
    else:
        model.eval()
        model.requires_grad_(False)
    return model


def _disable_dropout(model: torch.nn.Module) -> None:
    # Dropout makes the training forward differ from the server's; AReaL's disable_dropout zeroes every p.
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):  # attention layers keep their own copy
            module.attention_dropout = 0.0
    for key in ("attention_dropout", "hidden_dropout", "embd_pdrop", "resid_pdrop", "attn_pdrop"):
        if hasattr(model.config, key):
            setattr(model.config, key, 0.0)


def _enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    # use_reentrant=False, PyTorch's recommended variant: the reentrant one passes no gradient through a block none
    # of whose inputs requires grad, and warns on every call.
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
        model.activation_checkpointing_enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _fully_shard(model: torch.nn.Module, device: torch.device, world: int) -> None:
    """FSDP2: shard every decoder layer, then the root (embeddings, final norm, LM head)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if type(module).__name__ in layer_classes:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _build_optimizer(model: torch.nn.Module, opt: OptimizerConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if opt.type == "adam":
        # fused=True as AReaL 1.0.4's FSDP engine: one kernel over all tensors, several times faster on a CPU than
        # torch's default loop of small kernels, one per tensor per operation.
        return torch.optim.AdamW(
            params, lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps, weight_decay=opt.weight_decay, fused=True
        )
    if opt.type == "sgd":
        return torch.optim.SGD(params, lr=opt.lr, weight_decay=opt.weight_decay)
    raise ValueError(f"optimizer.type must be adam or sgd, got {opt.type!r}")


def _optimizer_and_schedule(
    model: torch.nn.Module, opt: OptimizerConfig, ft_spec: Optional[FinetuneSpec]
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    optimizer = _build_optimizer(model, opt)
    total = ft_spec.total_train_steps if ft_spec is not None else None
    if total is None and opt.lr_scheduler_type != "constant":
        warnings.warn("no FinetuneSpec given: the learning rate stays constant after warmup", stacklevel=3)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(opt, total))


def _lr_lambda(opt: OptimizerConfig, total_steps: Optional[int]):
    """The LR factor of optimizer step `step`: linear warm-up, then constant, linear or cosine decay to the floor."""
    warmup = int(opt.warmup_steps_proportion * total_steps) if total_steps else 0
    kind, floor = opt.lr_scheduler_type, opt.min_lr_ratio
    if kind not in ("constant", "linear", "cosine"):
        raise ValueError(f"lr_scheduler_type must be constant, linear or cosine, got {kind!r}")

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup  # reaches 1 on the last warmup step; the first step is not wasted
        if kind == "constant" or not total_steps:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        if kind == "linear":
            return floor + (1 - floor) * (1 - progress)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def _group_norm(cfg: Optional[NormConfig], group_size: int) -> Optional[NormConfig]:
    """`cfg` with the actor's group size when it left its own at 1 (the group size is given once, on the actor)."""
    if cfg is not None and cfg.group_size == 1 and group_size > 1:
        import dataclasses

        return dataclasses.replace(cfg, group_size=group_size)
    return cfg


# ----------------------------------------------------------------------------------------------------------------
# Statistics of one minibatch


def _clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """Clip the gradients' global norm to `max_norm` (0 or less: no clipping); returns the norm before."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm and max_norm > 0 else math.inf)
    if hasattr(norm, "full_tensor"):  # DTensor under FSDP2
        norm = norm.full_tensor()
    return float(norm)


def _zero() -> torch.Tensor:
    return torch.zeros((), dtype=torch.float64)


def _minus_inf() -> torch.Tensor:
    return torch.tensor(-math.inf, dtype=torch.float64)


_MAX = {"reduce": "max"}  # field metadata: combined over ranks by max (the other fields are sums)


def _finite_or_zero(x: float) -> float:
    return x if math.isfinite(x) else 0.0  # a maximum over no policy token at all


@dataclass
class _UpdateStats:
    """Sums (and maxima) over the policy tokens of one minibatch: float64 on CPU, so long sums do not drift."""

    loss: torch.Tensor = field(default_factory=_zero)  # the step's loss: the micro-batches' scaled losses
    n_tokens: torch.Tensor = field(default_factory=_zero)
    clipped: torch.Tensor = field(default_factory=_zero)
    dual_clipped: torch.Tensor = field(default_factory=_zero)
    ratio: torch.Tensor = field(default_factory=_zero)  # rho = exp(l_theta - l_prox)
    behav_w: torch.Tensor = field(default_factory=_zero)  # w = exp(l_prox - l_behav), 0 where capped
    capped: torch.Tensor = field(default_factory=_zero)
    approx_kl: torch.Tensor = field(default_factory=_zero)  # sum of l_theta - l_prox
    entropy: torch.Tensor = field(default_factory=_zero)
    # k1 estimate of KL(behaviour || proximal) on behaviour samples: how stale or mismatched the data is.
    behav_kl: torch.Tensor = field(default_factory=_zero)
    ratio_max: torch.Tensor = field(default_factory=_minus_inf, metadata=_MAX)
    ratio_min_neg: torch.Tensor = field(default_factory=_minus_inf, metadata=_MAX)  # -min: one MAX reduces both
    behav_w_max: torch.Tensor = field(default_factory=_minus_inf, metadata=_MAX)

    @torch.no_grad()
    def add_microbatch(
        self,
        m: torch.Tensor,
        info: Dict[str, torch.Tensor],
        loss: torch.Tensor,
        logp: torch.Tensor,
        prox: torch.Tensor,
        behav: torch.Tensor,
        entropies: torch.Tensor,
    ) -> None:
        """Add one micro-batch: its policy mask `m`, `ppo_token_loss`'s info, its loss (its share of the step's
        loss), the log-probs and the entropy of every policy token's distribution."""
        md = m.double()
        ratio, w = info["ratio"].double(), info["behav_w"].double()
        self.loss += loss.detach().double().cpu()
        self.n_tokens += md.sum().cpu()
        self.clipped += info["clipped"].double().sum().cpu()
        self.dual_clipped += info["dual_clipped"].double().sum().cpu()
        self.ratio += (ratio * md).sum().cpu()
        self.behav_w += (w * md).sum().cpu()
        self.capped += info["capped"].double().sum().cpu()
        self.approx_kl += ((logp.detach().double() - prox.double()) * md).sum().cpu()
        self.entropy += entropies.double().sum().cpu()
        self.behav_kl += ((behav.double() - prox.double()) * md).sum().cpu()
        if m.any():
            self.ratio_max = torch.maximum(self.ratio_max, ratio[m].max().cpu())
            self.ratio_min_neg = torch.maximum(self.ratio_min_neg, -ratio[m].min().cpu())
            self.behav_w_max = torch.maximum(self.behav_w_max, w[m].max().cpu())

    def all_reduce(self, dist: Any, device: torch.device) -> None:
        """Combine the ranks' statistics: one SUM all-reduce of the sums, one MAX all-reduce of the maxima."""
        for op, reduce_op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX)):
            names = [f.name for f in fields(self) if f.metadata.get("reduce", "sum") == op]
            packed = torch.stack([getattr(self, name) for name in names]).to(device)
            dist.all_reduce(packed, op=reduce_op)
            for name, value in zip(names, packed.cpu()):
                setattr(self, name, value)

    def report(self) -> Dict[str, float]:
        """Means over policy tokens (the loss: the step's, summed over micro-batches and ranks), and the extremes."""
        n = max(float(self.n_tokens), 1.0)
        return {
            "loss": float(self.loss),
            "n_tokens": float(self.n_tokens),
            "clip_frac": float(self.clipped) / n,
            "dual_clip_frac": float(self.dual_clipped) / n,
            "importance_weight": float(self.ratio) / n,
            "importance_weight_max": _finite_or_zero(float(self.ratio_max)),
            "importance_weight_min": _finite_or_zero(float(-self.ratio_min_neg)),
            "behav_imp_weight": float(self.behav_w) / n,
            "behav_imp_weight_max": _finite_or_zero(float(self.behav_w_max)),
            "behav_capped_frac": float(self.capped) / n,
            "approx_kl": float(self.approx_kl) / n,
            "behav_kl": float(self.behav_kl) / n,
            "entropy": float(self.entropy) / n,
        }


# ----------------------------------------------------------------------------------------------------------------
# The actor: the engine that holds the model, and the algorithm on top


class _TrainEngine(TrainEngine):
    """The model under training, without the algorithm: the process group, loading and sharding, the packed
    forward, gradient clipping and the LR schedule, versions, weight publishing and checkpoints (`weights.py`),
    teardown.

    AReaL splits its actor the same way (`FSDPPPOActor` is an `FSDPEngine` that hands the algorithm to a
    `PPOActor`): what a PPO step computes then reads apart from how a model is held, sharded and shipped to the
    servers. Only `FSDPPPOActor` is meant to be constructed.
    """

    def __init__(self, config: PPOActorConfig, ref_config: Optional[PPOActorConfig] = None):
        self.config = config
        self.ref_config = ref_config
        self.model: Optional[torch.nn.Module] = None
        self.ref_model: Optional[torch.nn.Module] = None
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.lr_scheduler: Optional[torch.optim.lr_scheduler.LambdaLR] = None
        self.device = torch.device("cpu")
        self.model_path = ""
        self._version = 0
        self._rank, self._world = 0, 1
        self._owns_process_group = False
        self._group_ready = False
        self._engine = None  # connect_engine(): the rollout engine update_weights() hands new weights to
        # The weight-update folders this actor writes, removed on destroy() or at exit, and its NCCL group.
        self._weights = WeightPublisher()
        self.last_sync_bytes = 0  # bytes the last disk weight update wrote (the adapter only, with use_lora)
        self._dtype = _DTYPES.get(config.dtype)
        if self._dtype is None:
            raise ValueError(f"actor.dtype must be one of {sorted(_DTYPES)}, got {config.dtype!r}")
        # What initialize() decides from the dtype and the device (`_precision_plan`): the weights' dtype, and
        # whether forward passes autocast to bf16 (CPU only).
        self._param_dtype = self._dtype
        self._autocast_bf16 = False
        # Sequences with the same prompt compute it once in every forward pass ("Shared prompts"); False runs
        # each sequence whole (the tests compare the two).
        self.share_prompts = True
        # ppo_update runs no forward or backward for rows whose advantages are all zero ("Rows without signal");
        # False computes them (the tests compare the two).
        self.skip_silent_rows = True

    # ---------------------------------------------------------------- setup

    def create_process_group(self, parallel_strategy: Any = None) -> None:
        """AReaL's first call after construction: join torch.distributed when launched as several processes
        (`WORLD_SIZE > 1`, e.g. torchrun: data-parallel FSDP2). One process needs no group. `parallel_strategy` is
        AReaL's (tensor/pipeline layouts); the kit only does data parallelism and ignores it."""
        self._group_ready = True
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return
        import torch.distributed as dist

        if not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() and self.config.device != "cpu" else "gloo"
            dist.init_process_group(backend)
            self._owns_process_group = True
        self._rank, self._world = dist.get_rank(), dist.get_world_size()

    def initialize(self, addr: Any = None, ft_spec: Optional[FinetuneSpec] = None) -> "FSDPPPOActor":
        """Load the model, optimizer and LR schedule: AReaL's `initialize(None, ft_spec)` (or `ft_spec=` alone)."""
        if isinstance(addr, FinetuneSpec):
            addr, ft_spec = None, addr
        from areal_lite.utils.device import keep_freed_memory, pick_device, set_torch_threads
        from areal_lite.utils.model_store import resolve_model_path

        cfg = self.config
        set_torch_threads(int(cfg.threads or 0))
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        if not self._group_ready:
            self.create_process_group()
        if self._world > 1 and torch.cuda.is_available() and cfg.device != "cpu":
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)
        else:
            self.device = pick_device(cfg.device)
        if self.device.type == "cpu":
            keep_freed_memory()  # an update allocates ~1 GB of large blocks: reuse them (utils.device)

        if not cfg.path:
            raise ValueError("actor.path is empty: give a model folder, alias (smollm2-135m-instruct) or hub id")
        self._param_dtype, self._autocast_bf16, note = _precision_plan(self._dtype, self.device)
        if note and self._rank == 0:
            print(note)
        self.model_path = resolve_model_path(cfg.path)
        self.model = _load_model(self.model_path, self._param_dtype, self.device, trainable=True)
        if cfg.gradient_checkpointing:
            _enable_gradient_checkpointing(self.model)
        if cfg.disable_dropout:
            _disable_dropout(self.model)
        if cfg.use_lora:  # after dropout/checkpointing, which act on the base modules peft wraps
            self.model = apply_lora(self.model, cfg, self._world, verbose=self._rank == 0)
        if self.ref_config is not None:
            ref_path = resolve_model_path(self.ref_config.path or cfg.path)
            self.ref_model = _load_model(ref_path, self._param_dtype, self.device, trainable=False)
        if self._world > 1:
            for model in (self.model, self.ref_model):
                if model is not None:
                    _fully_shard(model, self.device, self._world)
        elif self.device.type == "cpu":  # the LM head's forward on oneDNN where measured faster (`cpu_linear`)
            for model in (self.model, self.ref_model):
                if model is not None:
                    use_onednn_head(model)

        if cfg.optimizer is not None:  # AReaL's None: an engine that does not train (log-probs only)
            self.optimizer, self.lr_scheduler = _optimizer_and_schedule(self.model, cfg.optimizer, ft_spec)
        return self

    # ---------------------------------------------------------------- packing and forward

    def _autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast around a forward pass where `_precision_plan` chose it; else nothing. The backward needs
        none: autograd replays each op in the dtype its forward ran in."""
        if self._autocast_bf16:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _logits_for(
        self,
        model: torch.nn.Module,
        packed: Dict[str, torch.Tensor],
        targets: torch.Tensor,
        policy: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """Logits [K, V] that predict the tokens at the K positions `targets` of one packed row (bf16 under
        autocast: every log-softmax downstream computes in at least float32).

        Logits only where the loss needs them: the LM head runs only at those positions. The head over the whole
        vocabulary is a large share of a small model's cost (SmolLM2: 28M of 135M weights), and prompts are most of
        the tokens.

        Shared prompts: given the row's policy mask, sequences with the same prompt (a GRPO group's samples) compute
        it once, the rest of each sequence attending to that one copy (`packing.share_prompts`; flash attention on
        a GPU runs the plain packed row). The shared prompt's gradient is the sum of its samples' gradients, as if
        each had its own copy, so losses and gradients equal the plain row's up to float rounding
        (`tests/test_shared_prompts.py`)."""
        row = None
        if policy is not None and self.share_prompts and model.config._attn_implementation == PACKED_SDPA:
            row = share_prompts(packed, policy)
        with self._autocast():
            if row is None:
                return packed_forward(model, packed, keep=targets - 1)  # position t-1 predicts token t
            return shared_prefix_forward(model, row, row.pred_of[targets])

    def _policy_logp(
        self, model: torch.nn.Module, packed: Dict[str, torch.Tensor], mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs [T] of the tokens where `mask` is set, 0 elsewhere; the K entropies of the distributions
        that predicted them, detached)."""
        pred = torch.nonzero(mask[1:]).flatten()  # position t-1 predicts token t
        logits = self._logits_for(model, packed, pred + 1, mask)
        return scatter_logp_and_entropy(logits, packed["input_ids"], pred, self.config.temperature)

    def _dummy_forward_backward(self, model: torch.nn.Module, backward: bool) -> None:
        """Keep FSDP collectives in step when this rank has fewer micro-batches than another."""
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        with self._autocast():
            logits = model(input_ids=ids, position_ids=torch.zeros_like(ids), use_cache=False).logits
        if backward:
            (logits.sum() * 0.0).backward()

    def _microbatches(self, batch: Dict[str, torch.Tensor], rows: Sequence[int]) -> List[List[int]]:
        """This rank's micro-batches of `rows`, padded with empty ones to the same count on every rank."""
        mine = list(rows)[self._rank :: self._world]
        valid = batch["attention_mask"].bool()
        lengths = [int(valid[i].sum()) for i in mine]
        if self.share_prompts and "loss_mask" in batch:
            # A group in one micro-batch runs its prompt once ("Shared prompts"); the budget counts it once.
            budget = self.config.mb_spec.max_tokens_per_mb or math.inf
            items = prompt_groups([row_prompt(batch, i) for i in mine], lengths, budget)
        else:
            items = [([j], n) for j, n in enumerate(lengths)]
        bins = split_into_microbatches([size for _, size in items], self.config.mb_spec)
        mbs = [sorted(mine[j] for k in mb for j in items[k][0]) for mb in bins]
        dist = _dist()
        if dist is not None and self._world > 1:
            n = torch.tensor([len(mbs)], dtype=torch.long, device=self.device)
            dist.all_reduce(n, op=dist.ReduceOp.MAX)
            mbs += [[] for _ in range(int(n.item()) - len(mbs))]
        return mbs

    @torch.no_grad()
    def _logp_of(self, model: torch.nn.Module, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        """`compute_logp` under `model`: each rank packs its rows, and the disjoint results are summed."""
        B, L = batch["input_ids"].shape
        out = torch.zeros(B, L, dtype=torch.float32, device=self.device)
        was_training = model.training
        model.eval()
        valid = batch["attention_mask"].bool().to(self.device)
        try:
            for rows in self._microbatches(batch, range(B)):
                if not rows:
                    self._dummy_forward_backward(model, backward=False)
                    continue
                packed = pack_rows(batch, rows, ["loss_mask"] if "loss_mask" in batch else [], self.device)
                targets = torch.nonzero(~packed["seq_start"]).flatten()  # every token a sequence predicts
                policy = packed.get("loss_mask")
                logits = self._logits_for(model, packed, targets, None if policy is None else policy.bool())
                lp = scatter_next_token_logp(logits, packed["input_ids"], targets - 1, self.config.temperature)
                # Scatter the packed values back to their padded rows.
                sel = torch.zeros(B, L, dtype=torch.bool, device=self.device)
                sel[rows] = valid[rows]
                out[sel] = lp.float()
        finally:
            model.train(was_training)
        dist = _dist()
        if dist is not None and self._world > 1:
            dist.all_reduce(out)  # rows are disjoint across ranks
        return out.to(batch["input_ids"].device)

    # ---------------------------------------------------------------- versions and weights (weights.py)

    def set_version(self, version: int) -> None:
        self._version = int(version)

    def get_version(self) -> int:
        return self._version

    def _full_state_dict(self) -> Dict[str, torch.Tensor]:
        """Full (unsharded) model state on CPU; a collective under FSDP (all ranks call it), rank 0 gets it."""
        return full_state_dict(self.model, self._world)

    def _write_hf_folder(self, state: Dict[str, torch.Tensor], out_dir: str) -> None:
        """`state` as a folder `from_pretrained` loads, with the tokenizer files of the model this actor loaded."""
        write_hf_folder(self.model, state, out_dir, self.model_path)

    def connect_engine(self, engine: Any, meta: WeightUpdateMeta) -> None:
        """AReaL's hand-off: after this, `update_weights(meta)` also makes `engine`'s servers load the new weights
        and returns when they did (AReaL 1.0.4's order: call it between `engine.pause()` and `engine.resume()`)."""
        self._engine = engine
        if meta.is_broadcast:
            self.prepare_nccl_meta(meta, n_server_gpus=len(getattr(engine, "addresses", [])) or 1)

    def update_weights(self, meta: WeightUpdateMeta) -> None:
        """Publish the current weights as version get_version() + 1 (disk) or broadcast them (NCCL).

        With an engine connected (`connect_engine`) the engine loads them too, and this returns once every server
        did; without one, call `engine.update_weights(meta)` yourself before this (it waits for the folder).
        """
        self._require_model()
        future = None
        if self._engine is not None and self._rank == 0:
            future = self._engine.update_weights(meta)  # waits for the folder this call is about to write
        if bool(meta.use_lora) != bool(self.config.use_lora):
            raise ValueError(
                f"WeightUpdateMeta.use_lora={meta.use_lora} but actor.use_lora={self.config.use_lora}: the servers "
                "would be sent the wrong kind of weights (set both, as AReaL's WeightUpdateMeta.from_disk(use_lora=))"
            )
        if meta.type == "disk":
            self._update_weights_disk(meta)
        elif meta.is_broadcast:
            if self.config.use_lora:
                raise NotImplementedError("LoRA adapters are synced through disk only (AReaL's rule for SGLang)")
            self._update_weights_nccl(meta)
        else:
            raise ValueError(f"WeightUpdateMeta.type must be 'disk', 'xccl' or 'nccl', got {meta.type!r}")
        if future is not None:
            future.result()

    upload_weights = update_weights  # AReaL's older name

    def _update_weights_disk(self, meta: WeightUpdateMeta) -> None:
        version = self.get_version() + 1
        final = meta.dir_for(version)  # a meta for another version fails here, on every rank alike
        write = self._model_writer()  # collective: every rank takes part
        if self._rank == 0:
            reuse = recycled_file(self.config.use_lora)
            folder = self._weights.write_version(final, version, meta.keep_last, write, reuse=reuse)
            self.last_sync_bytes = folder_bytes(folder)
        self._barrier()

    def _model_writer(self) -> Callable[[str], None]:
        """What fills a weight version or a checkpoint's model folder: the full HF folder, or with `use_lora` the
        adapter alone. Gathers the full state first (a collective under FSDP: every rank calls this)."""
        if self.config.use_lora:
            return partial(write_adapter_folder, self.model, adapter_state_dict(self.model))
        return partial(self._write_hf_folder, self._full_state_dict())

    def _update_weights_nccl(self, meta: WeightUpdateMeta) -> None:
        """Broadcast every parameter from trainer rank 0 to the SGLang servers (GPU only).

        The engine must POST /init_weights_update_group (servers take ranks 1..N of the group) before or while the
        first call runs, and POST /update_weights_from_distributed with the names/dtypes/shapes of
        `weight_update_specs()` while the broadcasts run.
        """
        require_cuda(self.device)
        self._broadcast_params(self._weights.nccl_group_for(meta) if self._rank == 0 else None)
        self._barrier()

    def _broadcast_params(self, group) -> None:
        """Rank 0 broadcasts every parameter, in `weight_update_specs()` order, over `group` (others only gather)."""
        broadcast_params(self.model, group, send=self._rank == 0)

    def weight_update_specs(self) -> List[Dict[str, Any]]:
        """names, dtypes, shapes in broadcast order (what /update_weights_from_distributed expects)."""
        return weight_update_specs(self.model)

    def prepare_nccl_meta(self, meta: WeightUpdateMeta, n_server_gpus: int = 1) -> WeightUpdateMeta:
        """Put what the engine and this actor need on an NCCL `meta`: names/dtypes/shapes and the group size.

        Call once before the first `engine.update_weights(meta)` (the engine sends the specs to the servers).
        """
        return fill_nccl_meta(meta, self.weight_update_specs(), n_server_gpus)

    def save(self, path: str) -> None:
        """Model (a loadable HF folder under path/model; with `use_lora` the adapter folder), optimizer, LR
        schedule, version and RNG states."""
        self._require_model()
        write_model = self._model_writer()  # collectives: every rank takes part
        optim_state = None if self.optimizer is None else full_optimizer_state(self.model, self.optimizer)
        if self._rank == 0:
            save_checkpoint(path, write_model, optim_state, self.lr_scheduler, self._version)
        self._barrier()

    def load(self, path: str) -> None:
        """Restore what `save` wrote (weights, optimizer, schedule, version, RNG); with `use_lora` the adapter, the
        base weights staying those of `actor.path`."""
        self._require_model()
        load_weights = partial(load_adapter_folder, self.model) if self.config.use_lora else None
        self._version = load_checkpoint(path, self.model, self.optimizer, self.lr_scheduler, load_weights)

    # ---------------------------------------------------------------- teardown

    def _barrier(self) -> None:
        dist = _dist()
        if dist is not None and self._world > 1:
            dist.barrier()

    def _require_model(self) -> None:
        if self.model is None:
            raise RuntimeError("FSDPPPOActor is not initialized: call actor.initialize(ft_spec) first")

    def destroy(self) -> None:
        """Free the model and optimizer, remove the weight-update folders this actor wrote (checkpoints from `save`
        stay), and end the process group if this actor started it."""
        self._weights.close()
        self.model = self.ref_model = self.optimizer = self.lr_scheduler = None
        if self._owns_process_group:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            self._owns_process_group = False


class FSDPPPOActor(_TrainEngine):
    """PPO/GRPO trainer of a causal LM (one process, or FSDP2 under torchrun). See the module docstring.

    The methods here are the algorithm (log-probs, advantages, the PPO update and its micro-batch loop); set-up,
    weight updates, checkpoints and teardown come from `_TrainEngine`.
    """

    # ---------------------------------------------------------------- log-probs

    def compute_logp(self, data: Batch) -> Union[torch.Tensor, List[torch.Tensor]]:
        """Log-probs [B, L] of the batch's tokens under the current weights (no grad), aligned like `logprobs`.

        Position t holds log softmax(z_{t-1} / temperature)[x_t]; 0 at t = 0 and on padding. Prompt tokens get
        their real log-probs too (the loss masks them). With AReaL's list of trajectories (the only input AReaL
        1.0.4 takes), one tensor per trajectory: `for traj, lp in zip(data, actor.compute_logp(data)):
        traj["prox_logp"] = lp`; with one dict, `batch["prox_logp"] = actor.compute_logp(batch)` (kit only).
        Alignment differs from AReaL's: AReaL's position t holds log p(token t+1) (rolled by one), the kit's the
        log-prob of token t itself, like the rollout's `logprobs`; each side's actor reads its own convention.
        """
        self._require_model()
        if isinstance(data, list):
            return split_trajectories(self._logp_of(self.model, join_trajectories(data)), data)
        return self._logp_of(self.model, as_long(data))

    def compute_ref_logp(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        """Log-probs under the reference model (same alignment as `compute_logp`)."""
        if self.ref_model is None:
            raise RuntimeError(
                "no reference model: construct FSDPPPOActor(config, ref_config=...) or put ref_logp in the batch"
            )
        return self._logp_of(self.ref_model, batch)

    # ---------------------------------------------------------------- advantages

    def compute_advantages(self, data: Batch) -> Union[Dict[str, float], List[Dict[str, torch.Tensor]]]:
        """Add `advantages`, `kl_rewards`, `norm_rewards` (and `norm_token_returns`) to the batch, in place.

        Reads only keys it never writes (`rewards`, `token_returns`, `loss_mask`, `logprobs`, `prox_logp`,
        `ref_logp`), so calling it twice gives the same result. AReaL's list of trajectories (the only input AReaL
        1.0.4 takes): normalises over all of them together and returns the list, the stats then in
        `actor.last_advantage_stats`. AReaL returns new dicts and leaves its input as it was, the kit updates the
        dicts in place: `data = actor.compute_advantages(data)` runs the same on both. One dict (kit only): returns
        a few scalar stats. The formulas: `functional.py`.
        """
        if isinstance(data, list):
            joined = join_trajectories(data)
            self.last_advantage_stats = self.compute_advantages(joined)
            for key in ("advantages", "kl_rewards", "norm_rewards", "norm_token_returns", "ref_logp"):
                if key in joined:
                    for traj, part in zip(data, split_trajectories(joined[key], data)):
                        traj[key] = part
            return data
        batch = data
        cast_long(batch)
        for key in ("input_ids", "attention_mask", "loss_mask", "logprobs", "rewards"):
            if key not in batch:
                raise KeyError(f"compute_advantages: the batch has no {key!r} key (got {sorted(batch)})")
        cfg = self.config
        B, L = batch["input_ids"].shape
        mask = policy_mask(batch["loss_mask"], batch["attention_mask"])
        rewards = batch["rewards"].float().reshape(-1)
        if rewards.shape[0] != B:
            raise ValueError(f"rewards must have shape [B] = [{B}], got {tuple(batch['rewards'].shape)}")
        shape = partial(shape_rewards, bias=cfg.reward_bias, scaling=cfg.reward_scaling, clip=cfg.reward_clip)
        reward_norm = _group_norm(cfg.reward_norm, cfg.group_size)
        norm_rewards = normalize(shape(rewards), torch.ones_like(mask[:, 0]), reward_norm)
        kl = self._kl_rewards(batch, mask)
        if "token_returns" in batch:
            per_token = normalize_turn_returns(batch["token_returns"], mask, reward_norm, shape)
            batch["norm_token_returns"] = per_token
        else:
            per_token = norm_rewards.unsqueeze(-1).expand(B, L) * mask
        adv = grpo_advantages(per_token.float(), kl.float(), mask)
        adv_norm = _group_norm(cfg.adv_norm, cfg.group_size)
        if adv_norm is not None:
            adv = normalize(adv, mask, adv_norm)
        batch["advantages"] = adv.float()
        batch["kl_rewards"] = kl.float()
        batch["norm_rewards"] = norm_rewards.float()
        n = mask.sum().clamp(min=1)
        return {
            "reward": float(rewards.mean()),
            "norm_reward": float(norm_rewards.mean()),
            "advantage": float((adv * mask).sum() / n),
            "kl_reward": float((kl * mask).sum() / n),
        }

    def _kl_rewards(self, batch: Dict[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
        """KL reward to the reference policy on policy tokens (0 without `kl_ctl`); caches `ref_logp` in the batch."""
        cfg = self.config
        if cfg.kl_ctl == 0.0:
            return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        if "ref_logp" not in batch:
            if self.ref_model is None:
                raise RuntimeError(
                    "kl_ctl != 0 needs a reference: FSDPPPOActor(config, ref_config=...) or batch['ref_logp']"
                )
            batch["ref_logp"] = self.compute_ref_logp(batch)  # cached: a second call reads the same values
        # The old policy is the behaviour policy, or the proximal one without the decoupled loss (as AReaL does).
        old = batch["prox_logp"] if (not cfg.use_decoupled_loss and "prox_logp" in batch) else batch["logprobs"]
        return kl_rewards(old, batch["ref_logp"], mask, cfg.kl_ctl, cfg.kl_estimator)

    # ---------------------------------------------------------------- PPO update

    def ppo_update(self, data: Batch) -> Dict[str, float]:
        """`ppo_n_minibatches` optimizer steps on the batch (AReaL's list of trajectories, or one dict), each
        `train_batch`'s step (`_train_rows`) with the package's PPO loss (`ppo_loss_fn`) on a contiguous chunk of
        rows (whole GRPO groups when the sizes divide). Returns each minibatch's means over policy tokens, averaged
        over minibatches, with `skipped`, `n_tokens` and `silent_rows` summed. AReaL's returns None and logs its
        statistics through `areal.utils.stats_tracker`."""
        batch = self._train_ready(data)
        cfg = self.config
        if "advantages" not in batch:
            raise KeyError("ppo_update: no 'advantages' in the batch; call actor.compute_advantages(batch) first")
        B = batch["input_ids"].shape[0]
        n_mini = max(1, min(int(cfg.ppo_n_minibatches), B))
        if cfg.use_decoupled_loss and "prox_logp" not in batch and n_mini > 1:
            # After the first minibatch the weights have moved: the proximal policy needs a pass of its own.
            # With one minibatch, the update's own forward supplies it (see _microbatch_backward).
            if not cfg.recompute_logprob:
                raise KeyError("use_decoupled_loss with several minibatches needs batch['prox_logp'] "
                               "(or recompute_logprob=True)")  # fmt: skip
            batch["prox_logp"] = self.compute_logp(batch)
        bounds = [round(j * B / n_mini) for j in range(n_mini + 1)]
        silent = self._silent_rows(batch) if self.skip_silent_rows else set()
        t0 = time.perf_counter()
        per_step = [
            self._train_rows(
                batch, list(range(bounds[j], bounds[j + 1])), self.ppo_loss_fn, count_policy_tokens, silent
            )
            for j in range(n_mini)
        ]
        stats = {k: sum(s[k] for s in per_step) / len(per_step) for k in per_step[0]}
        for key in ("skipped", "n_tokens"):
            stats[key] = float(sum(s[key] for s in per_step))
        stats["silent_rows"] = float(len(silent))
        stats["update_time"] = time.perf_counter() - t0
        return stats

    def train_batch(self, input_: Batch, loss_fn: LossFn, loss_weight_fn: WeightFn) -> Dict[str, float]:
        """One optimizer step on the whole batch with your loss: AReaL's `TrainEngine.train_batch`.

        `loss_fn(logprobs, entropy, input_data, **kwargs)` is called once per micro-batch and returns that
        micro-batch's loss, normalised by its own size. `input_data` is the micro-batch packed into one row: every
        [B, L] key of the batch as a 1-D tensor [T], with `loss_mask` the tokens the loss may cover (generated
        tokens, never a row's first). `logprobs` [T] are the current weights' log-probs of those tokens (with
        gradient; 0 elsewhere), aligned like `input_data["logprobs"]`; `entropy` [T] is detached. Each micro-batch's
        loss is scaled by loss_weight_fn(its input_data) / (the sum over all micro-batches and ranks), so the step
        minimises the global mean, however the batch is split. `ppo_update` is this call with `ppo_loss_fn`.
        Returns the stats `ppo_update` returns (approx KL, clip fraction, ... measured from the log-probs, whatever
        the loss, and `update_time`) but `silent_rows`: every row trains here, since any loss may need it.
        """
        batch = self._train_ready(input_)
        t0 = time.perf_counter()
        stats = self._train_rows(batch, list(range(batch["input_ids"].shape[0])), loss_fn, loss_weight_fn)
        stats["update_time"] = time.perf_counter() - t0
        return stats

    def ppo_loss_fn(
        self, logprobs: torch.Tensor, entropy: torch.Tensor, input_data: Dict[str, torch.Tensor], **kwargs: Any
    ) -> torch.Tensor:
        """The package's loss in `train_batch`'s shape: the decoupled PPO loss (`ppo_token_loss`, with this
        config's clips and cap) averaged over the micro-batch's policy tokens."""
        cfg = self.config
        m = input_data["loss_mask"].bool()
        behav = input_data["logprobs"].to(logprobs.dtype)
        prox = input_data["prox_logp"].to(logprobs.dtype) if cfg.use_decoupled_loss else behav
        per_token, _ = ppo_token_loss(
            logprobs,
            prox,
            behav,
            input_data["advantages"],
            m,
            cfg.eps_clip,
            cfg.eps_clip_higher,
            cfg.c_clip,
            cfg.behav_imp_weight_cap,
            cfg.use_decoupled_loss,
        )
        return per_token.sum() / m.sum().clamp(min=1)

    def step_lr_scheduler(self) -> None:
        self._require_optimizer()
        self.lr_scheduler.step()

    def _require_optimizer(self) -> None:
        self._require_model()
        if self.optimizer is None:  # AReaL asserts here
            raise RuntimeError("this actor has no optimizer (config.optimizer is None, AReaL's sign of an engine "
                               "that does not train): give it an OptimizerConfig to train it")  # fmt: skip

    def _train_ready(self, batch: Batch) -> Dict[str, torch.Tensor]:
        """One batch (AReaL's list joined), ids cast, the keys every update reads present, the model in train mode."""
        if isinstance(batch, list):
            batch = join_trajectories(batch)
        cast_long(batch)
        self._require_optimizer()
        for key in ("input_ids", "attention_mask", "loss_mask", "logprobs"):
            if key not in batch:
                raise KeyError(f"train_batch: the batch has no {key!r} key (got {sorted(batch)})")
        self.model.train()
        return batch

    @staticmethod
    def _silent_rows(batch: Dict[str, torch.Tensor]) -> set:
        """Rows whose advantages are zero at every policy token: `ppo_loss_fn` is exactly zero on them, with a
        zero gradient ("Rows without signal": a GRPO group whose samples all scored the same).

        `ppo_update` runs no forward or backward for them; their policy tokens still count in the global mean's
        denominator, so the step is the same as computing them (`tests/test_actor.py`). The statistics then cover the
        computed rows, and `silent_rows` says how many were not. `train_batch` computes every row: it cannot know
        whether your loss vanishes with the advantage."""
        mask = policy_mask(batch["loss_mask"], batch["attention_mask"])
        signal = (batch["advantages"].to(torch.float64) * mask).ne(0).any(dim=1)
        return {int(i) for i in torch.nonzero(~signal).flatten()}

    def _train_rows(
        self, batch, rows: List[int], loss_fn: LossFn, loss_weight_fn: WeightFn, silent: Collection[int] = ()
    ) -> Dict[str, float]:
        """One optimizer step on `rows`: every micro-batch's backward, then clip and step (or skip). Rows in
        `silent` have a zero loss and gradient: they count in the loss weights but run no forward pass.

        A step whose gradient norm is not finite is skipped: gradients zeroed, no optimizer step, `skipped = 1` in the
        stats. One bad batch must not turn every weight into NaN."""
        B, L = batch["input_ids"].shape
        mask = policy_mask(batch["loss_mask"], batch["attention_mask"])
        self._check_same_batch(mask[rows])
        # Every per-token key travels with the micro-batch, as in AReaL; `loss_mask` becomes the policy mask.
        work = dict(batch, loss_mask=mask)
        keys = [
            k
            for k, v in work.items()
            if torch.is_tensor(v)
            and v.shape[:2] == (B, L)
            and v.dim() == 2
            and k not in ("input_ids", "attention_mask")
        ]
        quiet = [r for r in rows if r in silent]
        active = [r for r in rows if r not in silent]
        packs = [pack_rows(work, mb, keys, self.device) if mb else None for mb in self._microbatches(work, active)]
        weights = [float(loss_weight_fn(p)) if p is not None else 0.0 for p in packs]
        # The silent rows' weight, once over all ranks (every rank knows them): the denominator is unchanged.
        quiet_weight = 0.0
        if quiet and self._rank == 0:
            quiet_weight = float(loss_weight_fn(pack_rows(work, quiet, keys, self.device)))
        total = torch.tensor([sum(weights) + quiet_weight], dtype=torch.float64, device=self.device)
        dist = _dist()
        if dist is not None and self._world > 1:
            dist.all_reduce(total)
        total = max(float(total), 1e-12)
        self.optimizer.zero_grad(set_to_none=True)
        stats = _UpdateStats()
        for packed, weight in zip(packs, weights):
            if packed is None:
                self._dummy_forward_backward(self.model, backward=True)
            else:
                self._microbatch_backward(packed, loss_fn, weight / total, stats)
        if dist is not None and self._world > 1:
            stats.all_reduce(dist, self.device)
        if not packs:  # every row silent: no backward ran, but AdamW must still step (momentum, weight decay)
            for p in self.model.parameters():
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
        grad_norm = _clip_grad_norm(self.model, self.config.optimizer.gradient_clipping)
        skipped = not math.isfinite(grad_norm)
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        lr = float(self.optimizer.param_groups[0]["lr"])
        return {**stats.report(), "grad_norm": grad_norm, "skipped": float(skipped), "lr": lr}

    def _check_same_batch(self, mask_rows: torch.Tensor) -> None:
        """Ranks must hold the same batch: a silent mismatch would scale every rank's loss wrongly."""
        dist = _dist()
        if dist is not None and self._world > 1:
            n = mask_rows.sum().to(torch.float64)
            check = torch.stack([n, -n]).to(self.device)
            dist.all_reduce(check, op=dist.ReduceOp.MAX)
            if float(check[0]) != -float(check[1]):
                raise RuntimeError("ranks were given different batches (policy-token counts differ)")

    def _microbatch_backward(
        self, packed: Dict[str, torch.Tensor], loss_fn: LossFn, share: float, stats: _UpdateStats
    ) -> None:
        """Forward and backward of one packed micro-batch: its loss times its share of the step's weight."""
        cfg = self.config
        m = packed["loss_mask"].bool()
        logp, entropies = self._policy_logp(self.model, packed, m)  # an entropy per policy token
        token_entropy = torch.zeros_like(logp, requires_grad=False).masked_scatter(m, entropies.to(logp.dtype))
        if "prox_logp" not in packed:
            # One optimizer step: the weights of this forward pass are the proximal policy, so their detached
            # log-probs are exactly what a separate compute_logp pass would return, one forward pass cheaper.
            packed["prox_logp"] = logp.detach()
        if share == 0.0:
            loss = logp.sum() * 0.0  # keeps the backward (and FSDP's collectives) without a loss to add
        else:
            loss = loss_fn(logp, token_entropy, packed) * share
        (loss * float(self._world)).backward()  # FSDP2 averages gradients over ranks; the global mean needs the sum
        # Diagnostics come from the log-probs, not from loss_fn: the same numbers whatever loss was trained.
        behav = packed["logprobs"].to(logp.dtype)
        prox = packed["prox_logp"].to(logp.dtype) if "prox_logp" in packed else behav
        adv = packed["advantages"] if "advantages" in packed else torch.zeros_like(logp)
        with torch.no_grad():
            _, info = ppo_token_loss(
                logp.detach(),
                prox,
                behav,
                adv,
                m,
                cfg.eps_clip,
                cfg.eps_clip_higher,
                cfg.c_clip,
                cfg.behav_imp_weight_cap,
                cfg.use_decoupled_loss and "prox_logp" in packed,
            )
        stats.add_microbatch(m, info, loss, logp, prox, behav, entropies)
