"""The PPO/GRPO actor: recompute log-probs, compute advantages, take PPO steps, hand weights to the servers.

Method names follow AReaL-lite's `FSDPPPOActor` (`initialize`, `compute_logp`, `compute_advantages`,
`ppo_update`, `step_lr_scheduler`, `update_weights`/`upload_weights`, `set_version`, `get_version`, `save`,
`load`, `destroy`) so a notebook cell reads the same in both projects. Every formula is the one in
`shared/reference/algorithm.md`; this docstring states the conventions the formulas leave open.

Design decisions
- Alignment. A batch is never shifted: position t of `logprobs`, `loss_mask`, `prox_logp`, `ref_logp`,
  `advantages` and `token_returns` all describe token t itself. The one place that deals with "the logit at
  position t predicts token t+1" is `next_token_logp`, which turns logits into a per-token log-prob aligned the same
  way (0 at the first token of every sequence). Nothing is rolled in place, so every method is idempotent: calling
  `compute_advantages` twice gives the same tensors, and the caller's keys are never rewritten. A policy token at
  the very first position of a row has no logit predicting it and is ignored by the loss.
- Advantages (GRPO: value = 0, gamma = lambda = 1). Per row, R~ = clip((R + bias) * scale, -clip, clip), then
  `reward_norm` gives R^. Per policy token k, the KL reward is KL_k = -kl_ctl * est(l_old,k - l_ref,k) with
  l_old = behaviour log-probs (or `prox_logp` when `use_decoupled_loss=False`, as AReaL does), 0 off policy tokens.
  A_t = R^ + sum_{k >= t, policy} KL_k on policy tokens, 0 elsewhere; then `adv_norm` (token level, over policy
  tokens). The KL sum runs over all later policy tokens of the row, across turns.
- Multi-turn returns. If the batch has `token_returns` [B, L] (each turn's discounted return G_k written on that
  turn's tokens), it replaces R: a *turn* is a maximal run of consecutive policy tokens (turns are separated by
  feedback tokens); its return must be constant on the run. Each turn return goes through the same shaping, then
  `reward_norm` treats every (row, turn) pair as one sample: group statistics pool all turns of the G rows of a group
  (batch statistics pool all turns of the batch), each turn counted once whatever its length, leave-one-out leaving
  out that one turn. The normalised return G^ of a turn is written on its tokens and A_t = G^_t + sum_{k >= t} KL_k.
- Normalisation (`NormConfig`). x^ = (x - mu) / (sigma + eps). Groups are contiguous blocks of `group_size` rows.
  mean_level none -> mu = 0; std_level none -> sigma = 1. Leave-one-out: mu_i = (sum x - x_i) / (N - 1) (0 when
  N = 1). sigma is the (unbiased if `std_unbiased`) standard deviation around the ordinary mean of its pool (0 when
  the pool has fewer than 2 samples, so a constant group gives x^ = 0).
- Loss. rho = exp(l_theta - l_prox); L = max(-A rho, -A clip(rho, 1 - eps, 1 + eps_high)); with dual clip c > 1,
  L = min(L, c |A|) where A < 0; w = exp(l_prox - l_behav) without gradient, 0 where w > cap; without the decoupled
  loss l_prox = l_behav (so w = 1). The minibatch loss is sum(m w L) / sum(m): the token count is taken over the whole
  minibatch (all micro-batches, all ranks) *before* any forward pass, so splitting into micro-batches or ranks gives
  the same gradient as one big batch. `ppo_n_minibatches` splits the rows into that many contiguous chunks (whole
  GRPO groups when the sizes divide), one optimizer step each, in order.
- Micro-batches are packed: the rows of a micro-batch are unpadded and concatenated into one row whose
  `position_ids` restart at 0 for each sequence, and the sequence boundaries are passed as `cu_seq_lens_q/k` (the
  flash-attention varlen arguments). With flash attention (GPU) transformers uses them directly. Plain sdpa would
  turn the restarting position ids into a dense block-diagonal [T, T] mask, which on CPU means the slow masked
  kernel and attention work quadratic in the whole packed row; so the actor loads sdpa models with the
  `packed_sdpa` attention registered below: per sequence of the packed row it calls sdpa with `is_causal=True`
  (the fused kernel, no mask, work = sum of squared sequence lengths). Calls without `cu_seq_lens_q` (a padded
  batch) fall through to transformers' own sdpa with its usual mask. The tests check packed log-probs equal
  per-sequence ones. Rows go into micro-batches by first-fit-decreasing under `mb_spec.max_tokens_per_mb`, with at
  least `mb_spec.n_mbs` micro-batches; a row longer than the budget gets a micro-batch of its own (never split).
- Several processes (torchrun, WORLD_SIZE > 1): the model is wrapped with FSDP2 (`fully_shard` per decoder layer,
  then the root) over gloo on CPU or NCCL on CUDA. Every rank receives the same full batch and works on its share of
  the rows (rank r takes rows r, r + W, ...). FSDP2 averages gradients over ranks, so each rank's loss is multiplied
  by W to turn the average into the sum the global token mean needs. Collectives need the same number of forward and
  backward calls on every rank, so a rank with fewer micro-batches runs empty ones (a 1-token forward times 0).
- A step whose gradient norm is not finite is skipped: gradients are zeroed, the optimizer does not step, and the
  stats say `skipped = 1`.
- Weight updates through disk write version k = get_version() + 1 into a temporary folder beside
  `meta.dir_for(k)` (safetensors + config + generation config + tokenizer files, a complete Hugging Face folder) and
  rename it into place, so a server never sees half a checkpoint; then older version folders beyond `keep_last` are
  removed. The NCCL route (GPU + SGLang) broadcasts every parameter from trainer rank 0 over a process group shared
  with the servers (`prepare_nccl_meta` puts names/dtypes/shapes on the meta for the engine); on a machine without
  CUDA it raises a clear error. Its group set-up and broadcast are exercised in the tests with gloo instead of NCCL.
"""

from __future__ import annotations

import math
import os
import random
import shutil
import tempfile
import time
import warnings
import weakref
from typing import Any, Dict, List, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from .config import MicroBatchSpec, NormConfig, PPOActorConfig
from .io_struct import FinetuneSpec, WeightUpdateMeta
from .trajectory import concat_padded_tensors

__all__ = [
    "PPOActor",
    "normalize",
    "kl_estimate",
    "next_token_logp",
    "ppo_token_loss",
    "split_into_microbatches",
    "grpo_advantages",
]

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,  # tests only: the float64 reference checks
}

# Files besides the weights that make a weight folder a complete, loadable model folder.
_TOKENIZER_PREFIXES = ("tokenizer", "vocab", "merges", "special_tokens_map", "added_tokens", "chat_template")


# ----------------------------------------------------------------------------------------------------------------
# Pure functions (the formulas). Tested directly against float64 references.


def normalize(x: torch.Tensor, mask: torch.Tensor, cfg: Optional[NormConfig]) -> torch.Tensor:
    """x^ = (x - mu) / (sigma + eps) over the masked entries of x ([B] or [B, L]); 0 where mask is False.

    Pools are the whole batch (`batch`) or contiguous blocks of `cfg.group_size` rows (`group`). sigma is the spread
    around mu, the mean subtracted (AReaL 1.0.4's `Normalization`; `tests/test_areal_maths.py` compares the two).
    """
    if cfg is None:
        return torch.where(mask.bool(), x, torch.zeros_like(x))
    B = x.shape[0]
    G = max(1, int(cfg.group_size))
    for level in (cfg.mean_level, cfg.std_level):
        if level not in ("batch", "group", "none"):
            raise ValueError(f"NormConfig level must be batch, group or none, got {level!r}")
        if level == "group" and B % G:
            raise ValueError(
                f"group normalisation needs the batch size ({B}) to be a multiple of group_size ({G}); "
                "a grouped workflow returns exactly group_size contiguous rows per prompt"
            )
    xd = x.to(torch.float64)
    m = mask.to(torch.float64)
    xm = xd * m
    extra = (1,) * (x.dim() - 1)

    def pooled(level: str, t: torch.Tensor) -> torch.Tensor:
        """Sum of t over the pool of every row, broadcast back to the row: [B] (-> shape [B, 1...])."""
        per_row = t.reshape(B, -1).sum(-1)
        if level == "batch":
            s = per_row.sum().expand(B)
        else:
            s = per_row.view(B // G, G).sum(-1).repeat_interleave(G)
        return s.view(B, *extra)

    if cfg.mean_level == "none":
        mu = torch.zeros_like(xd)
    else:
        S, N = pooled(cfg.mean_level, xm), pooled(cfg.mean_level, m)
        if cfg.mean_leave1out:
            mu = torch.where(N > 1, (S - xm) / (N - 1).clamp(min=1), torch.zeros_like(S)).expand_as(xd)
        else:
            mu = (S / N.clamp(min=1)).expand_as(xd)
    if cfg.std_level == "none":
        return torch.where(mask.bool(), xd - mu, torch.zeros_like(xd)).to(x.dtype)
    # The spread around the mean actually subtracted, as AReaL 1.0.4 computes it: with mean_level "none" that is the
    # spread around 0, so a constant group of nonzero rewards is scaled to +-1-ish instead of divided by eps (1e5).
    N = pooled(cfg.std_level, m)
    sq = pooled(cfg.std_level, ((xd - mu) ** 2) * m)
    denom = N - 1 if cfg.std_unbiased else N
    var = torch.where(denom > 0, sq / denom.clamp(min=1), torch.zeros_like(sq))
    sigma = var.sqrt().expand_as(xd)
    if cfg.std_level == "group" and G == 1 and cfg.std_unbiased:
        sigma = torch.ones_like(xd)  # one row per group has no spread; AReaL divides by 1, not by eps
    out = (xd - mu) / (sigma + cfg.eps)
    return torch.where(mask.bool(), out, torch.zeros_like(out)).to(x.dtype)


KL_CLAMP = 10.0  # AReaL 1.0.4 clamps every estimate to [-10, 10]: one token far off the reference cannot dominate


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """k1 = D, k2 = D^2 / 2, k3 = exp(-D) - 1 + D with D = logp - ref_logp (per token), clamped to [-10, 10]."""
    d = logp - ref_logp
    if estimator == "k1":
        kl = d
    elif estimator == "k2":
        kl = d.pow(2) / 2
    elif estimator == "k3":
        kl = torch.expm1(-d) + d
    else:
        raise ValueError(f"kl_estimator must be k1, k2 or k3, got {estimator!r}")
    return kl.clamp(-KL_CLAMP, KL_CLAMP)


def next_token_logp(
    logits: torch.Tensor, input_ids: torch.Tensor, seq_start: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """THE shift. logits [T, V] of one packed row -> [T] with position t = log softmax(z_{t-1} / T)[x_t].

    Positions where a sequence starts (`seq_start` True) get 0: nothing inside their sequence predicts them.
    Computed in at least float32 (float64 stays float64).
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)
    z = logits[:-1].to(dtype) / temperature
    lp = z.gather(-1, input_ids[1:].unsqueeze(-1)).squeeze(-1) - z.logsumexp(-1)
    lp = F.pad(lp, (1, 0))
    return lp.masked_fill(seq_start, 0.0)


def _scatter_next_token_logp(
    logits: torch.Tensor, input_ids: torch.Tensor, pred: torch.Tensor, temperature: float
) -> torch.Tensor:
    """`next_token_logp` from logits taken at positions `pred` only: [T] with log-probs at pred + 1, 0 elsewhere."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    lp = z.gather(-1, input_ids[pred + 1].unsqueeze(-1)).squeeze(-1) - z.logsumexp(-1)
    return lp.new_zeros(input_ids.shape[0]).index_put((pred + 1,), lp)


def _entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Entropy of each row's next-token distribution (stats only)."""
    logp = (logits.float() / temperature).log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


def ppo_token_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_clip: float,
    eps_clip_higher: Optional[float] = None,
    c_clip: Optional[float] = None,
    behav_imp_weight_cap: Optional[float] = None,
    use_decoupled_loss: bool = True,
) -> tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Per-token decoupled PPO loss m * w * L (to be summed and divided by the global token count) and masks.

    Equal to AReaL 1.0.4's `ppo_actor_loss_fn` (loss and gradient; clip-higher, dual clip, and the cap as AReaL's
    token-level `rejection_sampling`), with one difference: without a cap AReaL applies no behaviour weight
    w = exp(prox - behav); the kit applies it whenever the loss is decoupled (tests/test_areal_maths.py).
    """
    m = mask.bool()
    zero = torch.zeros_like(logp)
    if not use_decoupled_loss:
        prox_logp = behav_logp
    # where() before exp(): off-policy positions hold unrelated numbers; keep them out of exp and the gradient.
    ratio = torch.exp(torch.where(m, logp - prox_logp, zero))
    eps_hi = eps_clip if eps_clip_higher is None else eps_clip_higher
    adv = torch.where(m, advantages.to(logp.dtype), zero)
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - eps_clip, 1.0 + eps_hi)
    loss = torch.maximum(loss1, loss2)
    clipped = (loss2 > loss1) & m
    dual = torch.zeros_like(m)
    if c_clip is not None:
        if c_clip <= 1:
            raise ValueError(f"c_clip must be > 1 (dual clip), got {c_clip}")
        loss3 = c_clip * adv.abs()
        dual = (adv < 0) & (loss > loss3) & m
        loss = torch.where(adv < 0, torch.minimum(loss, loss3), loss)
    with torch.no_grad():
        if use_decoupled_loss:
            w = torch.exp(torch.where(m, prox_logp - behav_logp, zero).to(logp.dtype))
        else:
            w = torch.ones_like(logp)
        capped = torch.zeros_like(m)
        if behav_imp_weight_cap is not None:
            capped = (w > behav_imp_weight_cap) & m
            w = torch.where(capped, zero, w)
        w = torch.where(m, w, zero)
    per_token = torch.where(m, loss * w, zero)
    info = {"ratio": ratio.detach(), "clipped": clipped, "dual_clipped": dual, "behav_w": w, "capped": capped}
    return per_token, info


def grpo_advantages(reward_per_token: torch.Tensor, kl_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A_t = r_t + sum_{k >= t} KL_k over policy tokens (value 0, gamma = lambda = 1); 0 off policy tokens."""
    m = mask.to(kl_rewards.dtype)
    kl = kl_rewards * m
    future_kl = kl.flip(-1).cumsum(-1).flip(-1)
    return (reward_per_token + future_kl) * m


def split_into_microbatches(lengths: Sequence[int], mb_spec: MicroBatchSpec) -> List[List[int]]:
    """Row indices per micro-batch: first-fit-decreasing under the token budget, at least `n_mbs` bins.

    Empty bins (fewer rows than n_mbs) are dropped. Rows inside a bin keep their original order.
    """
    n_min = max(1, int(mb_spec.n_mbs))
    budget = mb_spec.max_tokens_per_mb if mb_spec.max_tokens_per_mb else math.inf
    bins: List[List[int]] = [[] for _ in range(n_min)]
    loads = [0] * n_min
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        fits = [b for b in range(len(bins)) if loads[b] + lengths[i] <= budget]
        if fits:
            b = min(fits, key=lambda k: (loads[k], k))
        else:  # nothing fits (or the row alone exceeds the budget): a new micro-batch
            bins.append([])
            loads.append(0)
            b = len(bins) - 1
        bins[b].append(i)
        loads[b] += lengths[i]
    return sorted((sorted(b) for b in bins if b), key=lambda b: b[0])


def _turn_runs(mask_row: torch.Tensor) -> List[tuple[int, int]]:
    """[start, end) of every maximal run of ones in a 1-D 0/1 tensor."""
    m = mask_row.to(torch.int8).tolist()
    runs, start = [], None
    for t, v in enumerate(m + [0]):
        if v and start is None:
            start = t
        elif not v and start is not None:
            runs.append((start, t))
            start = None
    return runs


# ----------------------------------------------------------------------------------------------------------------
# Packed attention for sdpa (CPU, or GPU without flash attention)

PACKED_SDPA = "packed_sdpa"


def packed_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention function: causal sdpa per sequence of a packed row (see module docstring)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.pop("cu_seq_lens_q", None)
    for k in ("cu_seq_lens_k", "max_length_q", "max_length_k"):
        kwargs.pop(k, None)
    if cu is None or query.shape[0] != 1:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    bounds = cu.tolist()
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        out, _ = sdpa_attention_forward(
            module,
            query[:, :, a:b],
            key[:, :, a:b],
            value[:, :, a:b],
            None,
            dropout=dropout,
            scaling=scaling,
            is_causal=True,
        )
        outs.append(out)  # [1, t, heads, head_dim]
    return torch.cat(outs, dim=1), None


def _register_packed_sdpa() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_SDPA, sdpa_mask)  # non-packed calls get sdpa's usual masks


# ----------------------------------------------------------------------------------------------------------------
# Distributed helpers


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str):
    """A process group with processes outside the default world (the SGLang servers), as SGLang/AReaL build it."""
    from datetime import timedelta

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


def _remove_weight_dirs(dirs: List[str]) -> None:
    """Remove the weight versions in `dirs`, then each parent folder left empty (never anything else)."""
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    for root in {os.path.dirname(d) for d in dirs}:
        try:
            os.rmdir(root)
        except OSError:
            pass  # not empty (someone else's files) or already gone
    dirs.clear()


# ----------------------------------------------------------------------------------------------------------------
# The actor


Batch = Union[Dict[str, torch.Tensor], List[Dict[str, torch.Tensor]]]
_INT_KEYS = ("input_ids", "loss_mask", "versions")


def _cast_long(batch: Dict[str, torch.Tensor]) -> None:
    """Index-like keys as int64 in place (AReaL's batches hold int32; embedding, gather and masks want long)."""
    for key in _INT_KEYS:
        if key in batch and batch[key].dtype != torch.long:
            batch[key] = batch[key].long()


def _as_long(batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    out = dict(batch)
    _cast_long(out)
    return out


def _join(items: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """AReaL's list of trajectories as one right-padded batch (normalisation and packing see them all at once)."""
    if not items:
        raise ValueError("an empty list of trajectories: nothing to train on (did every rollout fail or get rejected?)")
    joined = concat_padded_tensors(items)
    _cast_long(joined)
    return joined


def _split(t: torch.Tensor, items: List[Dict[str, torch.Tensor]]) -> List[torch.Tensor]:
    """Per-trajectory slices of a joined [B, L] (or per-row [B]) tensor, cut back to each one's rows and length."""
    out, row = [], 0
    for item in items:
        rows, length = item["input_ids"].shape
        out.append(t[row : row + rows] if t.dim() == 1 else t[row : row + rows, :length])
        row += rows
    return out


class PPOActor:
    """PPO/GRPO trainer of a causal LM (one process, or FSDP2 under torchrun). See the module docstring."""

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
        self._nccl_group = None
        # Weight-update folders this actor wrote: transport, not checkpoints, so they are removed on destroy() or at
        # exit (each holds a full copy of the weights, often in RAM under /dev/shm).
        self._weight_dirs: List[str] = []
        self._cleanup = weakref.finalize(self, _remove_weight_dirs, self._weight_dirs)
        self._dtype = _DTYPES.get(config.dtype)
        if self._dtype is None:
            raise ValueError(f"actor.dtype must be one of {sorted(_DTYPES)}, got {config.dtype!r}")

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

    def initialize(self, addr: Any = None, ft_spec: Optional[FinetuneSpec] = None) -> "PPOActor":
        """Load the model, optimizer and LR schedule: AReaL's `initialize(None, ft_spec)` (or `ft_spec=` alone)."""
        if isinstance(addr, FinetuneSpec):
            addr, ft_spec = None, addr
        from .models import pick_device, resolve_model_path, set_torch_threads

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

        if not cfg.path:
            raise ValueError("actor.path is empty: give a model folder, alias (smollm2-135m-instruct) or hub id")
        self.model_path = resolve_model_path(cfg.path)
        self.model = self._load_model(self.model_path, trainable=True)
        if cfg.gradient_checkpointing:
            if hasattr(self.model, "activation_checkpointing_enable"):  # transformers >= 5.x name
                self.model.activation_checkpointing_enable({"use_reentrant": False})
            else:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.ref_config is not None:
            ref_path = resolve_model_path(self.ref_config.path or cfg.path)
            self.ref_model = self._load_model(ref_path, trainable=False)
        if self._world > 1:
            self._shard(self.model)
            if self.ref_model is not None:
                self._shard(self.ref_model)

        opt = cfg.optimizer
        params = [p for p in self.model.parameters() if p.requires_grad]
        if opt.type == "adam":
            self.optimizer = torch.optim.AdamW(
                params, lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps, weight_decay=opt.weight_decay
            )
        elif opt.type == "sgd":
            self.optimizer = torch.optim.SGD(params, lr=opt.lr, weight_decay=opt.weight_decay)
        else:
            raise ValueError(f"optimizer.type must be adam or sgd, got {opt.type!r}")
        total = ft_spec.total_train_steps if ft_spec is not None else None
        if total is None and opt.lr_scheduler_type != "constant":
            warnings.warn("no FinetuneSpec given: the learning rate stays constant after warmup", stacklevel=2)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_lambda(total))
        return self

    def _load_model(self, path: str, trainable: bool) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=self._dtype)
        if model.config._attn_implementation == "sdpa":
            _register_packed_sdpa()
            model.set_attn_implementation(PACKED_SDPA)
        model.config.use_cache = False
        model.to(self.device)
        if trainable:
            model.train()
        else:
            model.eval()
            model.requires_grad_(False)
        return model

    def _shard(self, model: torch.nn.Module) -> None:
        """FSDP2: shard every decoder layer, then the root (embeddings, final norm, LM head)."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(self.device.type, (self._world,))
        layer_classes = set(getattr(model, "_no_split_modules", None) or [])
        for module in model.modules():
            if type(module).__name__ in layer_classes:
                fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)

    def _lr_lambda(self, total_steps: Optional[int]):
        opt = self.config.optimizer
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

    # ---------------------------------------------------------------- packing and forward

    def _valid(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        return batch["attention_mask"].bool()

    def _pack(
        self, batch: Dict[str, torch.Tensor], rows: Sequence[int], keys: Sequence[str]
    ) -> Dict[str, torch.Tensor]:
        """Unpad `rows` and concatenate them into one row with restarting position ids."""
        valid = self._valid(batch)
        ids, pos, out = [], [], {k: [] for k in keys}
        for i in rows:
            v = valid[i]
            n = int(v.sum())
            ids.append(batch["input_ids"][i][v])
            pos.append(torch.arange(n))
            for k in keys:
                out[k].append(batch[k][i][v])
        position_ids = torch.cat(pos)
        packed = {k: torch.cat(vs).to(self.device) for k, vs in out.items()}
        packed["input_ids"] = torch.cat(ids).long().to(self.device)
        packed["position_ids"] = position_ids.to(self.device)
        packed["seq_start"] = (position_ids == 0).to(self.device)
        return packed

    def _forward(
        self, model: torch.nn.Module, packed: Dict[str, torch.Tensor], keep: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Logits [T, V] of one packed row, or [len(keep), V] at the positions `keep` only."""
        T = packed["input_ids"].shape[0]
        starts = torch.nonzero(packed["seq_start"]).flatten()
        cu = torch.cat([starts, torch.tensor([T], device=starts.device)]).to(torch.int32)
        max_len = int((cu[1:] - cu[:-1]).max())
        out = model(
            input_ids=packed["input_ids"].unsqueeze(0),
            position_ids=packed["position_ids"].unsqueeze(0),
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=max_len,
            max_length_k=max_len,
            use_cache=False,
            logits_to_keep=0 if keep is None else keep,
        )
        return out.logits[0]

    def _policy_logp(
        self, model: torch.nn.Module, packed: Dict[str, torch.Tensor], mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs [T] of the tokens where `mask` is set, 0 elsewhere; the logits [K, V] that predicted them).

        Logits only where the next token is a policy token: the LM head over the whole vocabulary is a large share
        of a small model's cost (SmolLM2: 28M of 135M weights), and prompts are most of the tokens.
        """
        pred = torch.nonzero(mask[1:]).flatten()  # position t-1 predicts token t
        logits = self._forward(model, packed, keep=pred)
        return _scatter_next_token_logp(logits, packed["input_ids"], pred, self.config.temperature), logits

    def _dummy_forward_backward(self, model: torch.nn.Module, backward: bool) -> None:
        """Keep FSDP collectives in step when this rank has fewer micro-batches than another."""
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        logits = model(input_ids=ids, position_ids=torch.zeros_like(ids), use_cache=False).logits
        if backward:
            (logits.sum() * 0.0).backward()

    def _rank_rows(self, rows: Sequence[int]) -> List[int]:
        return list(rows)[self._rank :: self._world]

    def _microbatches(self, batch: Dict[str, torch.Tensor], rows: Sequence[int]) -> List[List[int]]:
        """This rank's micro-batches of `rows`, padded with empty ones to the same count on every rank."""
        mine = self._rank_rows(rows)
        lengths = [int(self._valid(batch)[i].sum()) for i in mine]
        mbs = [[mine[j] for j in mb] for mb in split_into_microbatches(lengths, self.config.mb_spec)]
        dist = _dist()
        if dist is not None and self._world > 1:
            n = torch.tensor([len(mbs)], dtype=torch.long, device=self.device)
            dist.all_reduce(n, op=dist.ReduceOp.MAX)
            mbs += [[] for _ in range(int(n.item()) - len(mbs))]
        return mbs

    @torch.no_grad()
    def _logp_of(self, model: torch.nn.Module, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        B, L = batch["input_ids"].shape
        out = torch.zeros(B, L, dtype=torch.float32, device=self.device)
        was_training = model.training
        model.eval()
        valid = self._valid(batch).to(self.device)
        try:
            for rows in self._microbatches(batch, range(B)):
                if not rows:
                    self._dummy_forward_backward(model, backward=False)
                    continue
                packed = self._pack(batch, rows, [])
                lp = next_token_logp(
                    self._forward(model, packed), packed["input_ids"], packed["seq_start"], self.config.temperature
                )
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

    def compute_logp(self, batch: Batch) -> Union[torch.Tensor, List[torch.Tensor]]:
        """Log-probs [B, L] of the batch's tokens under the current weights (no grad), aligned like `logprobs`.

        Position t holds log softmax(z_{t-1} / temperature)[x_t]; 0 at t = 0 and on padding. Prompt tokens get
        their real log-probs too (the loss masks them). Use as `batch["prox_logp"] = actor.compute_logp(batch)`,
        or, with AReaL's list of trajectories, `for traj, lp in zip(batch, actor.compute_logp(batch)):
        traj["prox_logp"] = lp` (one tensor per trajectory).
        Alignment differs from AReaL's: AReaL's position t holds log p(token t+1) (rolled by one), the kit's the
        log-prob of token t itself, like the rollout's `logprobs`; each side's actor reads its own convention.
        """
        self._require_model()
        if isinstance(batch, list):
            joined = _join(batch)
            return _split(self._logp_of(self.model, joined), batch)
        return self._logp_of(self.model, _as_long(batch))

    def compute_ref_logp(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        """Log-probs under the reference model (same alignment as `compute_logp`)."""
        if self.ref_model is None:
            raise RuntimeError(
                "no reference model: construct PPOActor(config, ref_config=...) or put ref_logp in the batch"
            )
        return self._logp_of(self.ref_model, batch)

    # ---------------------------------------------------------------- advantages

    def _shape(self, r: torch.Tensor) -> torch.Tensor:
        c = self.config
        return ((r + c.reward_bias) * c.reward_scaling).clamp(-c.reward_clip, c.reward_clip)

    def _policy_mask(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        """loss_mask & valid, and never the first token of a row (no logit predicts it)."""
        m = batch["loss_mask"].bool() & self._valid(batch)
        m = m.clone()
        first = self._valid(batch).float().argmax(-1)
        m[torch.arange(m.shape[0]), first] = False
        return m

    def _norm_cfg(self, cfg: Optional[NormConfig]) -> Optional[NormConfig]:
        if cfg is not None and cfg.group_size == 1 and self.config.group_size > 1:
            import dataclasses

            return dataclasses.replace(cfg, group_size=self.config.group_size)
        return cfg

    def compute_advantages(self, batch: Batch) -> Union[Dict[str, float], List[Dict[str, torch.Tensor]]]:
        """Add `advantages`, `kl_rewards`, `norm_rewards` (and `norm_token_returns`) to the batch, in place.

        Reads only keys it never writes (`rewards`, `token_returns`, `loss_mask`, `logprobs`, `prox_logp`,
        `ref_logp`), so calling it twice gives the same result. One dict: returns a few scalar stats. AReaL's list
        of trajectories: normalises over all of them together and returns the list (each dict updated), as AReaL
        does; the stats are then in `actor.last_advantage_stats`.
        """
        if isinstance(batch, list):
            joined = _join(batch)
            self.last_advantage_stats = self.compute_advantages(joined)
            for key in ("advantages", "kl_rewards", "norm_rewards", "norm_token_returns", "ref_logp"):
                if key in joined:
                    for traj, part in zip(batch, _split(joined[key], batch)):
                        traj[key] = part
            return batch
        _cast_long(batch)
        for key in ("input_ids", "attention_mask", "loss_mask", "logprobs", "rewards"):
            if key not in batch:
                raise KeyError(f"compute_advantages: the batch has no {key!r} key (got {sorted(batch)})")
        cfg = self.config
        B, L = batch["input_ids"].shape
        mask = self._policy_mask(batch)
        rewards = batch["rewards"].float().reshape(-1)
        if rewards.shape[0] != B:
            raise ValueError(f"rewards must have shape [B] = [{B}], got {tuple(batch['rewards'].shape)}")
        reward_norm = self._norm_cfg(cfg.reward_norm)
        norm_rewards = normalize(self._shape(rewards), torch.ones_like(mask[:, 0]), reward_norm)

        # KL reward to the reference policy on policy tokens.
        if cfg.kl_ctl != 0.0:
            if "ref_logp" not in batch:
                if self.ref_model is None:
                    raise RuntimeError(
                        "kl_ctl != 0 needs a reference: PPOActor(config, ref_config=...) or batch['ref_logp']"
                    )
                batch["ref_logp"] = self.compute_ref_logp(batch)  # cached: a second call reads the same values
            old = batch["prox_logp"] if (not cfg.use_decoupled_loss and "prox_logp" in batch) else batch["logprobs"]
            d_old = torch.where(mask, old.float(), torch.zeros(()))
            d_ref = torch.where(mask, batch["ref_logp"].float(), torch.zeros(()))
            kl_rewards = -cfg.kl_ctl * kl_estimate(d_old, d_ref, cfg.kl_estimator) * mask
        else:
            kl_rewards = torch.zeros(B, L, dtype=torch.float32, device=mask.device)

        if "token_returns" in batch:
            per_token = self._normalised_token_returns(batch, mask, reward_norm)
            batch["norm_token_returns"] = per_token
        else:
            per_token = norm_rewards.unsqueeze(-1).expand(B, L) * mask
        adv = grpo_advantages(per_token.float(), kl_rewards.float(), mask)
        adv_norm = self._norm_cfg(cfg.adv_norm)
        if adv_norm is not None:
            adv = normalize(adv, mask, adv_norm)
        batch["advantages"] = adv.float()
        batch["kl_rewards"] = kl_rewards.float()
        batch["norm_rewards"] = norm_rewards.float()
        n = mask.sum().clamp(min=1)
        return {
            "reward": float(rewards.mean()),
            "norm_reward": float(norm_rewards.mean()),
            "advantage": float((adv * mask).sum() / n),
            "kl_reward": float((kl_rewards * mask).sum() / n),
        }

    def _normalised_token_returns(
        self, batch: Dict[str, torch.Tensor], mask: torch.Tensor, norm: Optional[NormConfig]
    ) -> torch.Tensor:
        """Per-turn returns -> shaped -> normalised over (row, turn) samples -> written back on the turn's tokens."""
        tr = batch["token_returns"].float()
        B, L = tr.shape
        runs = [_turn_runs(mask[i]) for i in range(B)]
        K = max([len(r) for r in runs] + [1])
        vals = torch.zeros(B, K, dtype=torch.float32, device=tr.device)
        present = torch.zeros(B, K, dtype=torch.bool, device=tr.device)
        for i, row_runs in enumerate(runs):
            for k, (s, e) in enumerate(row_runs):
                seg = tr[i, s:e]
                if (seg - seg[0]).abs().max() > 1e-6:
                    raise ValueError(
                        f"token_returns must be constant on each turn's tokens (row {i}, tokens {s}..{e - 1} differ)"
                    )
                vals[i, k], present[i, k] = seg[0], True
        normed = normalize(self._shape(vals), present, norm)
        out = torch.zeros(B, L, dtype=torch.float32, device=tr.device)
        for i, row_runs in enumerate(runs):
            for k, (s, e) in enumerate(row_runs):
                out[i, s:e] = normed[i, k]
        return out

    # ---------------------------------------------------------------- PPO update

    def ppo_update(self, batch: Batch) -> Dict[str, float]:
        """`ppo_n_minibatches` optimizer steps on the batch (one dict, or AReaL's list of trajectories); returns
        averaged stats (see module docstring). AReaL's returns None and logs its statistics through
        `areal.utils.stats_tracker`."""
        if isinstance(batch, list):
            batch = _join(batch)
        _cast_long(batch)
        self._require_model()
        cfg = self.config
        if "advantages" not in batch:
            raise KeyError("ppo_update: no 'advantages' in the batch; call actor.compute_advantages(batch) first")
        if cfg.use_decoupled_loss and "prox_logp" not in batch:
            if not cfg.recompute_logprob:
                raise KeyError("use_decoupled_loss needs batch['prox_logp'] (or recompute_logprob=True)")
            batch["prox_logp"] = self.compute_logp(batch)
        B = batch["input_ids"].shape[0]
        n_mini = max(1, min(int(cfg.ppo_n_minibatches), B))
        bounds = [round(j * B / n_mini) for j in range(n_mini + 1)]
        mask = self._policy_mask(batch)
        keys = ["logprobs", "advantages", "pmask"] + (["prox_logp"] if cfg.use_decoupled_loss else [])
        work = dict(batch)
        work["pmask"] = mask
        per_step: List[Dict[str, float]] = []
        t0 = time.perf_counter()
        self.model.train()
        for j in range(n_mini):
            rows = list(range(bounds[j], bounds[j + 1]))
            per_step.append(self._train_minibatch(work, rows, keys, mask))
        stats = {k: sum(s[k] for s in per_step) / len(per_step) for k in per_step[0]}
        stats["skipped"] = float(sum(s["skipped"] for s in per_step))
        stats["n_tokens"] = float(sum(s["n_tokens"] for s in per_step))
        stats["update_time"] = time.perf_counter() - t0
        return stats

    def _train_minibatch(self, work, rows, keys, mask) -> Dict[str, float]:
        cfg = self.config
        dist = _dist()
        n_global = mask[rows].sum().to(torch.float64)
        # Every rank holds the whole batch, so the global count needs no all-reduce here; ranks only disagree if
        # their batches do, which we check in the distributed case (a silent mismatch would scale the loss wrongly).
        if dist is not None and self._world > 1:
            check = torch.stack([n_global, -n_global]).to(self.device)
            dist.all_reduce(check, op=dist.ReduceOp.MAX)
            if float(check[0]) != -float(check[1]):
                raise RuntimeError("ranks were given different batches (policy-token counts differ)")
        n_global = max(float(n_global), 1.0)
        scale = float(self._world)  # FSDP2 averages gradients over ranks; we need their sum

        self.optimizer.zero_grad(set_to_none=True)
        sums = torch.zeros(9, dtype=torch.float64)  # loss, n, clipped, dual, ratio, w, capped, approx_kl, entropy
        maxes = torch.full((3,), -math.inf, dtype=torch.float64)  # ratio max, -ratio min, w max
        behav_kl = torch.zeros(1, dtype=torch.float64)
        for mb_rows in self._microbatches(work, rows):
            if not mb_rows:
                self._dummy_forward_backward(self.model, backward=True)
                continue
            packed = self._pack(work, mb_rows, keys)
            m = packed["pmask"].bool()
            logp, logits = self._policy_logp(self.model, packed, m)
            prox = packed["prox_logp"] if cfg.use_decoupled_loss else packed["logprobs"]
            per_token, info = ppo_token_loss(
                logp,
                prox.to(logp.dtype),
                packed["logprobs"].to(logp.dtype),
                packed["advantages"],
                m,
                cfg.eps_clip,
                cfg.eps_clip_higher,
                cfg.c_clip,
                cfg.behav_imp_weight_cap,
                cfg.use_decoupled_loss,
            )
            loss = per_token.sum() / n_global
            (loss * scale).backward()
            with torch.no_grad():
                md = m.double()
                ratio, w = info["ratio"].double(), info["behav_w"].double()
                sums += torch.stack(
                    [
                        loss.detach().double().cpu() * n_global,
                        md.sum().cpu(),
                        info["clipped"].double().sum().cpu(),
                        info["dual_clipped"].double().sum().cpu(),
                        (ratio * md).sum().cpu(),
                        (w * md).sum().cpu(),
                        info["capped"].double().sum().cpu(),
                        ((logp.detach().double() - prox.double()) * md).sum().cpu(),
                        _entropy(logits.detach(), cfg.temperature).double().sum().cpu(),  # one row per policy token
                    ]
                )
                # k1 estimate of KL(behaviour || proximal) on behaviour samples: how stale/mismatched the data is.
                behav_kl += ((packed["logprobs"].double() - prox.double()) * md).sum().cpu()
                if m.any():
                    maxes = torch.maximum(maxes, torch.stack([ratio[m].max(), -ratio[m].min(), w[m].max()]).cpu())
        if dist is not None and self._world > 1:
            red = torch.cat([sums, behav_kl]).to(self.device)
            dist.all_reduce(red)
            sums, behav_kl = red[:9].cpu(), red[9:].cpu()
            mx = maxes.to(self.device)
            dist.all_reduce(mx, op=dist.ReduceOp.MAX)
            maxes = mx.cpu()

        grad_norm = self._clip_grad_norm()
        skipped = not math.isfinite(grad_norm)
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        n = max(float(sums[1]), 1.0)
        return {
            "loss": float(sums[0]) / n_global,
            "n_tokens": float(sums[1]),
            "clip_frac": float(sums[2]) / n,
            "dual_clip_frac": float(sums[3]) / n,
            "importance_weight": float(sums[4]) / n,
            "importance_weight_max": float(maxes[0]) if math.isfinite(float(maxes[0])) else 0.0,
            "importance_weight_min": float(-maxes[1]) if math.isfinite(float(maxes[1])) else 0.0,
            "behav_imp_weight": float(sums[5]) / n,
            "behav_imp_weight_max": float(maxes[2]) if math.isfinite(float(maxes[2])) else 0.0,
            "behav_capped_frac": float(sums[6]) / n,
            "approx_kl": float(sums[7]) / n,
            "behav_kl": float(behav_kl[0]) / n,
            "entropy": float(sums[8]) / n,
            "grad_norm": grad_norm,
            "skipped": float(skipped),
            "lr": float(self.optimizer.param_groups[0]["lr"]),
        }

    def _clip_grad_norm(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        max_norm = self.config.optimizer.gradient_clipping
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm and max_norm > 0 else math.inf)
        if hasattr(norm, "full_tensor"):  # DTensor under FSDP2
            norm = norm.full_tensor()
        return float(norm)

    def step_lr_scheduler(self) -> None:
        self.lr_scheduler.step()

    # ---------------------------------------------------------------- versions and weights

    def set_version(self, version: int) -> None:
        self._version = int(version)

    def get_version(self) -> int:
        return self._version

    def _full_state_dict(self) -> Dict[str, torch.Tensor]:
        """Full (unsharded) model state on CPU; a collective under FSDP (all ranks call it), rank 0 gets it."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if self._world > 1:
            return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}

    def _write_hf_folder(self, state: Dict[str, torch.Tensor], out_dir: str) -> None:
        """safetensors + config + generation config + tokenizer files: a folder `from_pretrained` loads."""
        from safetensors.torch import save_file

        model = self.model
        tied = getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or {}
        if isinstance(tied, dict) and getattr(model.config, "tie_word_embeddings", False):
            drop = set(tied)
        else:
            drop = set()
        tensors = {k: v.detach().contiguous().cpu() for k, v in state.items() if k not in drop}
        # Two names for one storage would make safetensors refuse; clone the rare leftover aliases.
        seen: Dict[int, str] = {}
        for k, v in list(tensors.items()):
            ptr = v.untyped_storage().data_ptr()
            if ptr in seen and v.numel():
                tensors[k] = v.clone()
            seen[ptr] = k
        save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        model.config.save_pretrained(out_dir)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(out_dir)
        if self.model_path and os.path.isdir(self.model_path):
            for name in os.listdir(self.model_path):
                if name.startswith(_TOKENIZER_PREFIXES):
                    src = os.path.join(self.model_path, name)
                    if os.path.isfile(src):
                        shutil.copy2(src, os.path.join(out_dir, name))

    def _atomic_dir(self, final: str, fill) -> None:
        """Build a folder in a temp sibling with `fill(tmp)` (rank 0 only) and rename it to `final`."""
        parent = os.path.dirname(os.path.abspath(final))
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".tmp-{os.path.basename(final)}-", dir=parent)
        try:
            fill(tmp)
            if os.path.isdir(final):  # rewriting a version (e.g. after --resume): replace it
                old = tempfile.mkdtemp(prefix=f".old-{os.path.basename(final)}-", dir=parent)
                os.rename(final, os.path.join(old, "x"))
                os.rename(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

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
        if meta.type == "disk":
            self._update_weights_disk(meta)
        elif meta.is_broadcast:
            self._update_weights_nccl(meta)
        else:
            raise ValueError(f"WeightUpdateMeta.type must be 'disk', 'xccl' or 'nccl', got {meta.type!r}")
        if future is not None:
            future.result()

    upload_weights = update_weights  # AReaL's older name

    def _update_weights_disk(self, meta: WeightUpdateMeta) -> None:
        version = self.get_version() + 1
        final = meta.dir_for(version)
        state = self._full_state_dict()  # collective: every rank takes part
        if self._rank == 0:
            self._atomic_dir(final, lambda tmp: self._write_hf_folder(state, tmp))
            self._weight_dirs.append(final)
            self._prune_versions(os.path.dirname(final), keep_from=version - max(1, int(meta.keep_last)) + 1)
        dist = _dist()
        if dist is not None and self._world > 1:
            dist.barrier()

    @staticmethod
    def _prune_versions(root: str, keep_from: int) -> None:
        prefix = "weight_update_v"
        for name in os.listdir(root):
            number = name[len(prefix) :]
            if name.startswith(prefix) and number.isdigit() and int(number) < keep_from:
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)

    def _update_weights_nccl(self, meta: WeightUpdateMeta) -> None:
        """Broadcast every parameter from trainer rank 0 to the SGLang servers (GPU only).

        The engine must POST /init_weights_update_group (servers take ranks 1..N of the group) before or while the
        first call runs, and POST /update_weights_from_distributed with the names/dtypes/shapes of
        `weight_update_specs()` while the broadcasts run.
        """
        if not torch.cuda.is_available() or self.device.type != "cuda":
            raise NotImplementedError(
                "NCCL weight updates need CUDA GPUs and SGLang servers; on this machine use "
                "WeightUpdateMeta.from_disk(path) (the embedded CPU server loads weights from disk)"
            )
        dist = _dist()
        if self._rank == 0 and self._nccl_group is None:
            world = int(meta.nccl_world_size or 2)  # 1 trainer + the servers' GPUs
            self._nccl_group = _init_custom_process_group(
                "nccl",
                f"tcp://{meta.nccl_master_address}:{meta.nccl_master_port}",
                world_size=world,
                rank=0,
                group_name=meta.nccl_group_name,
            )
        self._broadcast_params(self._nccl_group)
        if dist is not None and self._world > 1:
            dist.barrier()

    def _broadcast_params(self, group) -> None:
        """Rank 0 broadcasts every parameter, in `weight_update_specs()` order, over `group` (others only gather)."""
        import torch.distributed as tdist

        for _, param in self.model.named_parameters():
            # Under FSDP2 every rank must take part in gathering the full tensor; only rank 0 sends it.
            tensor = param.data.full_tensor() if hasattr(param.data, "full_tensor") else param.data
            if self._rank == 0:
                tdist.broadcast(tensor.contiguous(), src=0, group=group)

    def weight_update_specs(self) -> List[Dict[str, Any]]:
        """names, dtypes, shapes in broadcast order (what /update_weights_from_distributed expects)."""
        return [
            {"name": n, "dtype": str(p.dtype).replace("torch.", ""), "shape": list(p.shape)}
            for n, p in self.model.named_parameters()
        ]

    def prepare_nccl_meta(self, meta: WeightUpdateMeta, n_server_gpus: int = 1) -> WeightUpdateMeta:
        """Put what the engine and this actor need on an NCCL `meta`: names/dtypes/shapes and the group size.

        Call once before the first `engine.update_weights(meta)` (the engine sends the specs to the servers).
        """
        specs = self.weight_update_specs()
        meta.names = [s["name"] for s in specs]
        meta.dtypes = [s["dtype"] for s in specs]
        meta.shapes = [s["shape"] for s in specs]
        meta.nccl_world_size = 1 + int(n_server_gpus)
        return meta

    # ---------------------------------------------------------------- checkpoints

    def save(self, path: str) -> None:
        """Model (a loadable HF folder under path/model), optimizer, LR schedule, version and RNG states."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        self._require_model()
        model_state = self._full_state_dict()
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        optim_state = get_optimizer_state_dict(self.model, self.optimizer, options=opts)
        if self._rank == 0:
            extra = {
                "optimizer": optim_state,
                "lr_scheduler": self.lr_scheduler.state_dict(),
                "version": self._version,
                "rng": {
                    "torch": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                    "python": random.getstate(),
                },
            }

            def fill(tmp: str) -> None:
                os.makedirs(os.path.join(tmp, "model"))
                self._write_hf_folder(model_state, os.path.join(tmp, "model"))
                torch.save(extra, os.path.join(tmp, "actor_state.pt"))

            self._atomic_dir(path, fill)
        dist = _dist()
        if dist is not None and self._world > 1:
            dist.barrier()

    def load(self, path: str) -> None:
        """Restore what `save` wrote (weights, optimizer, schedule, version, RNG)."""
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        self._require_model()
        model_file = os.path.join(path, "model", "model.safetensors")
        state_file = os.path.join(path, "actor_state.pt")
        for f in (model_file, state_file):
            if not os.path.isfile(f):
                raise FileNotFoundError(f"{path} is not an actor checkpoint: {f} is missing")
        weights = load_file(model_file)
        extra = torch.load(state_file, map_location="cpu", weights_only=False)
        opts = StateDictOptions(full_state_dict=True, strict=False)
        result = set_model_state_dict(self.model, weights, options=opts)
        tied = set(getattr(self.model, "all_tied_weights_keys", None) or {})
        missing = [k for k in (getattr(result, "missing_keys", None) or []) if k not in tied]
        if missing:
            raise RuntimeError(f"checkpoint {path} lacks weights {missing[:5]}")
        set_optimizer_state_dict(
            self.model, self.optimizer, extra["optimizer"], options=StateDictOptions(full_state_dict=True)
        )
        self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        self._version = int(extra["version"])
        rng = extra["rng"]
        torch.set_rng_state(rng["torch"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        random.setstate(rng["python"])

    # ---------------------------------------------------------------- teardown

    def _require_model(self) -> None:
        if self.model is None:
            raise RuntimeError("PPOActor is not initialized: call actor.initialize(ft_spec) first")

    def destroy(self) -> None:
        """Free the model and optimizer, remove the weight-update folders this actor wrote (checkpoints from `save`
        stay), and end the process group if this actor started it."""
        self._cleanup()
        self.model = self.ref_model = self.optimizer = self.lr_scheduler = None
        if self._owns_process_group:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            self._owns_process_group = False
