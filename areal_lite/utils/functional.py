"""The PPO/GRPO formulas as pure tensor functions: no model, no optimizer, no process group.

These are the lines a notebook shows and a learner copies into their own trainer, so each takes tensors and plain
numbers only, and each is tested on its own against float64 loops (`tests/test_functional.py`, `tests/test_actor.py`)
and, where AReaL has the same formula, against AReaL 1.0.4 (`tests/test_areal_maths.py`). The actor
(`engine/fsdp_engine.py`) only gathers the tensors and calls them; AReaL keeps its formulas in `areal.utils.functional`.

Conventions the formulas leave open, and why
- Alignment: a batch is never shifted. Position t of `logprobs`, `loss_mask`, `prox_logp`, `ref_logp`, `advantages`
  and `token_returns` describes token t itself; `next_token_logp` is the one place that deals with "logit t predicts
  token t+1". Nothing is rolled in place, so the actor's methods are idempotent.
- Advantages (GRPO: value 0, gamma = lambda = 1): the KL term sums over all later policy tokens of the row, across
  turns: a turn's choices shape every later turn of the episode (`grpo_advantages`).
- Multi-turn returns: each (row, turn) pair is one sample, counted once whatever its length, so a long answer does
  not outweigh a short one (`normalize_turn_returns`).
- A constant group normalises to 0, not to noise divided by eps (`normalize`).
- The kit's loss is per token (`ppo_token_loss`): the caller divides the sum by the whole minibatch's token count,
  so micro-batches and ranks add up exactly. AReaL's `ppo_actor_loss_fn` (a mean per call), `sapo_loss_fn` and
  `apply_rejection_sampling` are here too, with AReaL's stats, sharing its formulas (`tests/test_areal_losses.py`).
- Statistics that pool many samples are computed in float64 (a float32 sum drifts), then cast back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from areal_lite.utils.data import Normalization

if TYPE_CHECKING:  # annotations only: utils sits below api, whose configs these read by attribute
    from areal_lite.api.cli_args import NormConfig, RejectionSamplingConfig

__all__ = [
    "discounted_returns",
    "KL_CLAMP",
    "normalize",
    "kl_estimate",
    "kl_rewards",
    "next_token_logp",
    "scatter_next_token_logp",
    "entropy",
    "ppo_token_loss",
    "ppo_actor_loss_fn",
    "sapo_loss_fn",
    "apply_rejection_sampling",
    "RejectionSamplingResult",
    "grpo_advantages",
    "shape_rewards",
    "policy_mask",
    "turn_runs",
    "normalize_turn_returns",
]

KL_CLAMP = 10.0  # AReaL 1.0.4 clamps every estimate to [-10, 10]: one token far off the reference cannot dominate


def normalize(x: torch.Tensor, mask: torch.Tensor, cfg: Optional[NormConfig]) -> torch.Tensor:
    """x^ = (x - mu) / (sigma + eps) over the masked entries of x ([B] or [B, L]); 0 where mask is False; x's dtype.

    Pools are the whole batch (`batch`) or contiguous blocks of `cfg.group_size` rows (`group`). mean level None
    (or "none") -> mu = 0; std level None -> sigma = 1. Leave-one-out: mu_i = (sum x - x_i) / (N - 1) (0 when
    N = 1). sigma is the (unbiased if `std_unbiased`) spread around the mu subtracted, so a constant group gives
    x^ = 0 rather than noise divided by eps. The formula is AReaL 1.0.4's `Normalization`
    (`areal_lite.utils.data`), computed in float64 and, unlike AReaL's, never summed over ranks: the kit's trainer
    gives every rank the whole batch. cfg None: x, zeroed off the mask.
    """
    if cfg is None:
        return torch.where(mask.bool(), x, torch.zeros_like(x))
    out = Normalization(cfg).apply(x, mask, all_reduce=False)
    return torch.where(mask.bool(), out, torch.zeros_like(out)).to(x.dtype)


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str, clamp: bool = True) -> torch.Tensor:
    """k1 = D, k2 = D^2 / 2, k3 = exp(-D) - 1 + D with D = logp - ref_logp (per token), clamped to [-10, 10]
    unless `clamp` is False (rejection sampling compares the raw estimate with its bounds)."""
    d = logp - ref_logp
    if estimator == "k1":
        kl = d
    elif estimator == "k2":
        kl = d.pow(2) / 2
    elif estimator == "k3":
        kl = torch.expm1(-d) + d
    else:
        raise ValueError(f"kl_estimator must be k1, k2 or k3, got {estimator!r}")
    return kl.clamp(-KL_CLAMP, KL_CLAMP) if clamp else kl


def kl_rewards(
    old_logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, kl_ctl: float, estimator: str
) -> torch.Tensor:
    """KL_t = -kl_ctl * est(l_old,t - l_ref,t) on policy tokens (`mask`), 0 elsewhere; float32 [B, L]."""
    # where() before the estimate: off-policy positions hold unrelated numbers (k3 would exponentiate them).
    d_old = torch.where(mask, old_logp.float(), torch.zeros(()))
    d_ref = torch.where(mask, ref_logp.float(), torch.zeros(()))
    return -kl_ctl * kl_estimate(d_old, d_ref, estimator) * mask


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


def scatter_next_token_logp(
    logits: torch.Tensor, input_ids: torch.Tensor, pred: torch.Tensor, temperature: float
) -> torch.Tensor:
    """`next_token_logp` from logits taken at positions `pred` only: [T] with log-probs at pred + 1, 0 elsewhere."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    lp = z.gather(-1, input_ids[pred + 1].unsqueeze(-1)).squeeze(-1) - z.logsumexp(-1)
    return lp.new_zeros(input_ids.shape[0]).index_put((pred + 1,), lp)


def scatter_logp_and_entropy(
    logits: torch.Tensor, input_ids: torch.Tensor, pred: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`scatter_next_token_logp` and `entropy` (detached) from one log-softmax of the K rows of logits: the update
    needs both, and each pass over a [K, vocabulary] tensor costs as much as a small layer."""
    lp, ent = _LogpEntropy.apply(logits, input_ids[pred + 1], temperature)
    return lp.new_zeros(input_ids.shape[0]).index_put((pred + 1,), lp), ent


class _LogpEntropy(torch.autograd.Function):
    """For the rows of `logits`: log softmax(z / T) at each row's target, the entropy (no gradient), and the
    gradient of the first as autograd would compute it (gather's backward, log-softmax's, the division's), which
    a CPU runs `CPU_ROWS` rows at a time and a GPU over all rows at once.

    Why rows at a time on a CPU: the whole [K, vocabulary] tensor (the demo's update: 512 x 49k floats, 100 MB)
    would be streamed from memory by each of its dozen passes (temperature, log-softmax, gather, entropy; the
    gradient's scatter, log-softmax backward and temperature); a few rows stay in the core's cache through all of
    them (bench/update_speed.py measures the update). A GPU streams the whole tensor fast, and rows at a time
    would only add kernel launches. The same operations on any slicing give the same numbers bit for bit
    as the formula written on the whole tensor with autograd (tests/test_functional.py, on a CPU and on CUDA)."""

    CPU_ROWS = 16

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float):
        dtype = torch.promote_types(logits.dtype, torch.float32)
        K = logits.shape[0]
        rows = _LogpEntropy.CPU_ROWS if logits.device.type == "cpu" else max(K, 1)
        lps, ents, saved = [], [], []
        for a in range(0, max(K, 1), rows):  # K = 0 (no policy token) still makes one empty pass
            logp_all = (logits[a : a + rows].to(dtype) / temperature).log_softmax(-1)
            lps.append(logp_all.gather(-1, targets[a : a + rows, None]).squeeze(-1))
            ents.append(-(logp_all.exp() * logp_all).sum(-1))
            saved.append(logp_all)
        ctx.save_for_backward(targets, *saved)
        ctx.temperature, ctx.in_dtype = temperature, logits.dtype
        ent = torch.cat(ents)
        ctx.mark_non_differentiable(ent)
        return torch.cat(lps), ent

    @staticmethod
    def backward(ctx, grad_lp: torch.Tensor, _grad_ent: torch.Tensor):
        targets, *saved = ctx.saved_tensors
        grad, a = None, 0
        for logp_all in saved:
            b = a + logp_all.shape[0]
            # autograd's own steps: gather's backward (scatter_add into zeros), log-softmax's, the division's
            g = torch.zeros_like(logp_all).scatter_add_(-1, targets[a:b, None], grad_lp[a:b, None])
            g = torch._log_softmax_backward_data(g, logp_all, -1, logp_all.dtype)
            if len(saved) == 1:  # one pass (a GPU): no buffer of the whole gradient beside it
                return (g / ctx.temperature).to(ctx.in_dtype), None, None
            if grad is None:
                grad = g.new_empty(len(targets), g.shape[-1], dtype=ctx.in_dtype)
            torch.div(g, ctx.temperature, out=grad[a:b])  # straight into place (rounded to its dtype), no copy
            a = b
        return grad, None, None


def entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Entropy of each row's next-token distribution (reported, never trained on)."""
    logp = (logits.float() / temperature).log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


@dataclass
class RejectionSamplingResult:
    """`apply_rejection_sampling`'s answer: the loss mask to train on (the input's in clamp mode), the behaviour
    weight w = pi_prox / pi_behav (0 off that mask) and the fraction of valid tokens dropped or clamped (logged)."""

    loss_mask: torch.Tensor
    behave_imp_weight: torch.Tensor
    filtered_fraction: float


def _sequence_index(x: torch.Tensor, cu_seqlens: Optional[torch.Tensor]) -> Tuple[torch.Tensor, int]:
    """The sequence of every entry of `x` (flattened) and the number of sequences: a row of a padded [B, L] batch,
    a `cu_seqlens` segment of a packed [T] one."""
    if x.ndim == 2:
        return torch.arange(x.shape[0], device=x.device).repeat_interleave(x.shape[1]), x.shape[0]
    n = cu_seqlens.shape[0] - 1
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(x.device)
    return torch.arange(n, device=x.device).repeat_interleave(lengths), n


def _per_sequence(x: torch.Tensor, mask: torch.Tensor, idx: torch.Tensor, n: int, how: str) -> torch.Tensor:
    """Sum, mean or max of `x` over each sequence's masked entries, broadcast back to x's shape. A sequence with
    no masked entry gets 0 (its mean and max are otherwise undefined; nothing of it trains anyway)."""
    flat, m = x.reshape(-1), mask.reshape(-1).bool()
    if how == "max":
        out = flat.new_full((n,), float("-inf")).scatter_reduce(0, idx, flat.masked_fill(~m, float("-inf")), "amax")
        has_any = torch.zeros(n, dtype=torch.long, device=x.device).scatter_add(0, idx, m.long()) > 0
        out = torch.where(has_any, out, torch.zeros_like(out))
    else:
        out = flat.new_zeros(n).scatter_add(0, idx, torch.where(m, flat, torch.zeros_like(flat)))
        if how == "mean":
            out = out / flat.new_zeros(n).scatter_add(0, idx, m.to(flat.dtype)).clamp(min=1)
    return out[idx].view_as(x)


def _sequence_ratio_and_advantages(
    log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, cu_seqlens: Optional[torch.Tensor]
) -> Tuple[torch.Tensor, torch.Tensor]:
    """GSPO: every token of a sequence takes the geometric mean of its ratios and the mean of its advantages (a
    mean, not a sum: the gradient's size does not grow with the length); 0 off the mask."""
    if log_ratio.ndim == 1 and cu_seqlens is None:
        raise ValueError(
            "cu_seqlens is required for 1D tensors (packed format). A packed batch always has cu_seqlens; for a "
            "single sequence, use cu_seqlens=torch.tensor([0, seq_len], dtype=torch.int32)."
        )
    idx, n = _sequence_index(log_ratio, cu_seqlens)
    zero = torch.zeros_like(log_ratio)
    ratio = torch.where(mask, torch.exp(_per_sequence(log_ratio, mask, idx, n, "mean")), zero)
    adv = _per_sequence(advantages, mask, idx, n, "mean")
    return ratio, torch.where(mask, adv, torch.zeros_like(adv))


def _check_importance_sampling_level(level: str) -> None:
    if level not in ("token", "sequence"):
        raise ValueError(f"Invalid importance_sampling_level: {level}. Must be 'token' or 'sequence'.")


def apply_rejection_sampling(
    proximal_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: Optional[torch.Tensor],
    config: RejectionSamplingConfig,
) -> RejectionSamplingResult:
    """Drop (`mask`) or down-weight (`clamp`) the tokens whose proximal and behaviour policies disagree too much.

    log r = l_prox - l_behav (non-finite -> 0, so a token both policies rule out weighs 1, not NaN); the metric is
    r or a KL estimate of log r (unclamped), per token or aggregated per sequence (`config.agg`; the ratio in log
    space); it is kept when lower <= metric <= upper. w = r (at sequence level with the ratio metric: the sequence's
    geometric mean), clamped into [lower, upper] where out of bounds in clamp mode, 0 off the returned mask.
    Tensors are [B, L] (padded) or [T] (packed, with `cu_seqlens`); computed in float32 at least (float64 stays
    float64). AReaL 1.0.4's `apply_rejection_sampling` (tests/test_areal_losses.py).
    """
    for name, t in (("old_logprobs", old_logprobs), ("loss_mask", loss_mask)):
        if t.shape != proximal_logprobs.shape:
            raise ValueError(f"proximal_logprobs shape {proximal_logprobs.shape} != {name} shape {t.shape}")
    if proximal_logprobs.ndim not in (1, 2):
        raise ValueError(f"Expected 1D (packed) or 2D (padded) tensors, got ndim={proximal_logprobs.ndim}")
    dtype = torch.promote_types(proximal_logprobs.dtype, torch.float32)
    prox, behav = proximal_logprobs.detach().to(dtype), old_logprobs.detach().to(dtype)
    log_ratio = prox - behav
    log_ratio = torch.where(torch.isfinite(log_ratio), log_ratio, torch.zeros_like(log_ratio))
    is_ratio = config.metric == "ratio"
    if is_ratio:
        values = log_ratio  # aggregated in log space: a geometric mean is not inflated by one large ratio
    elif config.metric in ("kl_k1", "kl_k2", "kl_k3"):
        values = kl_estimate(prox, behav, config.metric[3:], clamp=False)
    else:
        raise ValueError(f"Unknown metric: {config.metric}")
    weight = torch.exp(log_ratio)
    valid = loss_mask.bool()
    if config.level == "sequence":
        if loss_mask.ndim == 1 and cu_seqlens is None:
            raise ValueError("cu_seqlens is required for 1D packed tensors in sequence-level filtering.")
        if config.agg not in ("sum", "mean", "max"):
            raise ValueError(f"Unknown agg method: {config.agg}")
        idx, n = _sequence_index(log_ratio, cu_seqlens)
        if is_ratio:
            weight = torch.exp(_per_sequence(log_ratio, valid, idx, n, "mean"))
        values = _per_sequence(values, valid, idx, n, config.agg)
    metric = torch.exp(values) if is_ratio else values
    in_bounds = metric <= config.upper
    if config.lower is not None:
        in_bounds &= metric >= config.lower
    if config.action == "mask":
        keep, changed, new_mask = valid & in_bounds, valid & ~in_bounds, (valid & in_bounds).to(loss_mask.dtype)
    else:
        lower = config.lower if config.lower is not None else 0.0
        clamped = torch.where(in_bounds, weight, weight.clamp(min=lower, max=config.upper))
        keep, changed, new_mask, weight = valid, valid & (clamped != weight), loss_mask, clamped
    fraction = changed.sum().item() / max(valid.sum().item(), 1)
    return RejectionSamplingResult(new_mask, torch.where(keep, weight, torch.zeros_like(weight)), fraction)


@dataclass(frozen=True)
class _TokenRatioCap:
    """What `behav_imp_weight_cap` means: `RejectionSamplingConfig(upper=cap)`'s rule (token level, ratio, mask above
    `upper`), read by `apply_rejection_sampling` by attribute. Built here because utils sits below api's configs;
    tests/test_areal_losses.py checks the two give the same result."""

    upper: float
    lower: Optional[float] = None
    level: str = "token"
    action: str = "mask"
    metric: str = "ratio"
    agg: str = "mean"


def _clipped_surrogate(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_clip: float,
    eps_clip_higher: Optional[float],
    c_clip: Optional[float],
    importance_sampling_level: str,
    cu_seqlens: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The PPO surrogate of every token (not yet masked or weighted), the ratio (0 off `mask`), the clip and
    dual-clip masks. L = max(-A rho, -A clip(rho, 1 - eps, 1 + eps_high)); with c: min(L, c |A|)."""
    _check_importance_sampling_level(importance_sampling_level)
    if importance_sampling_level == "sequence":
        ratio, advantages = _sequence_ratio_and_advantages(logprobs - proximal_logprobs, advantages, mask, cu_seqlens)
    else:
        # where() before exp(): off-mask positions hold unrelated numbers; keep them out of exp and the gradient.
        zero = torch.zeros_like(logprobs)
        ratio = torch.where(mask, torch.exp(torch.where(mask, logprobs - proximal_logprobs, zero)), zero)
    eps_high = eps_clip if eps_clip_higher is None else eps_clip_higher
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_high)
    clip_mask = (loss1.detach() < loss2.detach()) & mask
    loss = torch.maximum(loss1, loss2)
    dual_clip_mask = torch.zeros_like(clip_mask)
    if c_clip is not None:
        if not c_clip > 1.0:
            raise ValueError(f"c_clip must be > 1 (dual clip), got {c_clip}")
        loss3 = c_clip * advantages.abs()  # only ever below L where A < 0
        dual_clip_mask = (loss3.detach() < loss.detach()) & mask
        loss = torch.minimum(loss, loss3)
    return loss, ratio, clip_mask, dual_clip_mask


def ppo_actor_loss_fn(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    loss_mask: torch.Tensor,
    eps_clip_higher: Optional[float] = None,
    c_clip: Optional[float] = None,
    rejection_sampling: Optional[RejectionSamplingConfig] = None,
    importance_sampling_level: str = "token",
    cu_seqlens: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Dict[str, Any]]:
    """AReaL 1.0.4's PPO actor loss: (scalar loss, stats). Mean over `loss_mask`'s tokens of the clipped surrogate
    (`_clipped_surrogate`: clip-higher, dual clip, per-token or GSPO sequence ratios rho = pi_theta / pi_prox).

    With `rejection_sampling` the tokens it drops leave the loss but still count in the mean's denominator (as
    they do in the caller's loss weight), and each kept token's loss is multiplied by the behaviour weight
    w = pi_prox / pi_behav (`apply_rejection_sampling`); without it no behaviour weight is applied.
    Stats: per-token `loss`, `importance_weight` (rho), `approx_kl` (l_theta - l_prox), `clip_mask`,
    `dual_clip_mask`, and with rejection sampling `behave_approx_kl`, `behave_imp_weight`, `behave_mask`,
    `filtered_fraction`.
    """
    n_tokens = loss_mask.count_nonzero() or 1  # before rejection: the denominator does not shrink with it
    rs = None
    if rejection_sampling is not None:
        rs = apply_rejection_sampling(proximal_logprobs, old_logprobs, loss_mask, cu_seqlens, rejection_sampling)
        loss_mask = rs.loss_mask
    mask = loss_mask.bool()
    pg_loss, ratio, clip_mask, dual_clip_mask = _clipped_surrogate(
        logprobs,
        proximal_logprobs,
        advantages,
        mask,
        eps_clip,
        eps_clip_higher,
        c_clip,
        importance_sampling_level,
        cu_seqlens,
    )
    if rs is not None:
        pg_loss = pg_loss * rs.behave_imp_weight
    loss = torch.where(mask, pg_loss, torch.zeros_like(pg_loss)).sum() / n_tokens
    stat: Dict[str, Any] = dict(
        loss=pg_loss.detach(),
        importance_weight=ratio.detach(),
        approx_kl=(logprobs - proximal_logprobs).detach(),
        clip_mask=clip_mask,
        dual_clip_mask=dual_clip_mask,
    )
    if rs is not None:
        behave_mask = (rs.behave_imp_weight > 0) & mask
        behave_kl = (proximal_logprobs - old_logprobs).detach()
        stat.update(
            behave_approx_kl=torch.where(behave_mask, behave_kl, torch.zeros_like(behave_kl)),
            behave_imp_weight=rs.behave_imp_weight.detach(),
            behave_mask=behave_mask,
            filtered_fraction=rs.filtered_fraction,
        )
    return loss, stat


def sapo_loss_fn(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    tau_pos: float,
    tau_neg: float,
    loss_mask: torch.Tensor,
    importance_sampling_level: str = "token",
    cu_seqlens: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """AReaL 1.0.4's SAPO loss: PPO's clip replaced by a soft gate, (scalar loss, PPO-shaped stats).

    L = -(4 / tau) sigmoid(tau (rho - 1)) A with rho = pi_theta / pi_old (per token, or GSPO's sequence ratio) and
    tau = tau_pos where A > 0, else tau_neg; the mean over `loss_mask`'s tokens. The 4 / tau makes the gate's slope
    1 at rho = 1, as PPO's. There is no proximal policy (SAPO needs use_decoupled_loss=False) and nothing clips:
    `clip_mask` and `dual_clip_mask` are all False.
    """
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError("SAPO temperatures (tau_pos, tau_neg) must be positive.")
    _check_importance_sampling_level(importance_sampling_level)
    n_tokens = loss_mask.count_nonzero() or 1
    advantages = advantages.detach()
    log_ratio = logprobs - old_logprobs
    if importance_sampling_level == "sequence":
        ratio, advantages = _sequence_ratio_and_advantages(log_ratio, advantages, loss_mask, cu_seqlens)
    else:
        ratio = torch.exp(log_ratio)
    gate_pos = torch.sigmoid(tau_pos * (ratio - 1.0)) * (4.0 / tau_pos)
    gate_neg = torch.sigmoid(tau_neg * (ratio - 1.0)) * (4.0 / tau_neg)
    gate = torch.where(advantages > 0, gate_pos, gate_neg)
    pg_loss = -gate * advantages
    loss = torch.where(loss_mask, pg_loss, torch.zeros_like(pg_loss)).sum() / n_tokens
    no_clip = torch.zeros_like(loss_mask, dtype=torch.bool)
    stat = dict(
        loss=pg_loss.detach(),
        importance_weight=ratio.detach(),
        approx_kl=log_ratio.detach(),
        clip_mask=no_clip,
        dual_clip_mask=no_clip.clone(),
        sapo_soft_gate=gate.detach(),
        sapo_scaled_gate_pos=gate_pos.detach(),
        sapo_scaled_gate_neg=gate_neg.detach(),
    )
    return loss, stat


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

    rho = exp(l_theta - l_prox); L = max(-A rho, -A clip(rho, 1 - eps, 1 + eps_high)); with dual clip c > 1,
    L = min(L, c |A|) where A < 0; w = exp(l_prox - l_behav) without gradient, 0 where w > cap (a cap must be
    > 1); without the decoupled loss l_prox = l_behav (so w = 1). Advantages are cast to logp's dtype.

    The formulas of `ppo_actor_loss_fn` (its surrogate; the cap is its token-level `rejection_sampling`), per token
    so the caller can divide by the whole minibatch's count, with one difference: without a cap AReaL applies no
    behaviour weight w = exp(prox - behav); the kit applies it whenever the loss is decoupled (an infinite cap;
    tests/test_areal_maths.py). `info["ratio"]` is 0 off the mask.
    """
    m = mask.bool()
    if not use_decoupled_loss:
        prox_logp = behav_logp
    loss, ratio, clipped, dual = _clipped_surrogate(
        logp, prox_logp, advantages.to(logp.dtype), m, eps_clip, eps_clip_higher, c_clip, "token", None
    )
    with torch.no_grad():
        if use_decoupled_loss:
            cap = float("inf") if behav_imp_weight_cap is None else behav_imp_weight_cap
            rs = apply_rejection_sampling(prox_logp, behav_logp, m, None, _TokenRatioCap(upper=cap))
            w, capped = rs.behave_imp_weight, m & ~rs.loss_mask
        else:
            w, capped = m.to(logp.dtype), torch.zeros_like(m)
    per_token = torch.where(m, loss * w, torch.zeros_like(loss))
    info = {"ratio": ratio.detach(), "clipped": clipped, "dual_clipped": dual, "behav_w": w, "capped": capped}
    return per_token, info


def grpo_advantages(reward_per_token: torch.Tensor, kl_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A_t = r_t + sum_{k >= t} KL_k over policy tokens (value 0, gamma = lambda = 1); 0 off policy tokens.

    r_t is the normalised reward R^ (or turn return) and KL_k = -kl_ctl * est(l_old,k - l_ref,k) (`kl_rewards`). The
    KL sum runs over all later policy tokens of the row, across turns: a turn's choices shape every later turn."""
    m = mask.to(kl_rewards.dtype)
    kl = kl_rewards * m
    future_kl = kl.flip(-1).cumsum(-1).flip(-1)
    return (reward_per_token + future_kl) * m


def shape_rewards(r: torch.Tensor, bias: float, scaling: float, clip: float) -> torch.Tensor:
    """R~ = clip((R + bias) * scaling, -clip, clip): rewards (or turn returns) before normalisation."""
    return ((r + bias) * scaling).clamp(-clip, clip)


def policy_mask(loss_mask: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, L] bool: loss_mask & attention_mask, and never the first token of a row (no logit predicts it)."""
    valid = attention_mask.bool()
    m = (loss_mask.bool() & valid).clone()
    first = valid.float().argmax(-1)
    m[torch.arange(m.shape[0]), first] = False
    return m


def turn_runs(mask_row: torch.Tensor) -> List[Tuple[int, int]]:
    """[start, end) of every maximal run of ones in a 1-D 0/1 tensor: the turns of one row."""
    m = mask_row.to(torch.int8).tolist()
    runs, start = [], None
    for t, v in enumerate(m + [0]):
        if v and start is None:
            start = t
        elif not v and start is not None:
            runs.append((start, t))
            start = None
    return runs


def normalize_turn_returns(
    token_returns: torch.Tensor,
    mask: torch.Tensor,
    norm: Optional[NormConfig],
    shape: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> torch.Tensor:
    """Per-turn returns -> `shape` -> normalised over (row, turn) samples -> written back on each turn's tokens.

    `token_returns` [B, L] holds each turn's return on that turn's tokens; `mask` [B, L] marks the policy tokens.
    Returns float32 [B, L], 0 off policy tokens. A return that is not constant on its turn is a ValueError (the
    workflow wrote it wrong, and any one value picked from it would silently be arbitrary).

    A turn is a maximal run of consecutive policy tokens (turns are separated by feedback tokens). Normalisation
    treats every (row, turn) pair as one sample: group statistics pool all turns of the G rows of a group, each
    turn counted once whatever its length (a long answer must not outweigh a short one), leave-one-out leaving
    out that one turn.
    """
    tr = token_returns.float()
    B, L = tr.shape
    runs = [turn_runs(mask[i]) for i in range(B)]
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
    normed = normalize(vals if shape is None else shape(vals), present, norm)
    out = torch.zeros(B, L, dtype=torch.float32, device=tr.device)
    for i, row_runs in enumerate(runs):
        for k, (s, e) in enumerate(row_runs):
            out[i, s:e] = normed[i, k]
    return out


def discounted_returns(rewards: Sequence[float], gamma: float) -> List[float]:
    """Turn-level returns `G_k = r_k + gamma * G_{k+1}` (last turn: `G = r`)."""
    out = [0.0] * len(rewards)
    running = 0.0
    for k in reversed(range(len(rewards))):
        running = float(rewards[k]) + gamma * running
        out[k] = running
    return out
