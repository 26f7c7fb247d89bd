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
- The loss is per token; the caller divides the sum by the whole minibatch's token count, so micro-batches and
  ranks add up exactly (`ppo_token_loss`).
- Statistics that pool many samples are computed in float64 (a float32 sum drifts), then cast back.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from areal_lite.api.cli_args import NormConfig

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
    "grpo_advantages",
    "shape_rewards",
    "policy_mask",
    "turn_runs",
    "normalize_turn_returns",
]

KL_CLAMP = 10.0  # AReaL 1.0.4 clamps every estimate to [-10, 10]: one token far off the reference cannot dominate


def normalize(x: torch.Tensor, mask: torch.Tensor, cfg: Optional[NormConfig]) -> torch.Tensor:
    """x^ = (x - mu) / (sigma + eps) over the masked entries of x ([B] or [B, L]); 0 where mask is False.

    Pools are the whole batch (`batch`) or contiguous blocks of `cfg.group_size` rows (`group`). mean_level none ->
    mu = 0; std_level none -> sigma = 1. Leave-one-out: mu_i = (sum x - x_i) / (N - 1) (0 when N = 1). sigma is the
    (unbiased if `std_unbiased`) spread around mu, the mean subtracted, and 0 when the pool has fewer than 2 samples,
    so a constant group gives x^ = 0 rather than noise divided by eps (AReaL 1.0.4's `Normalization`;
    `tests/test_areal_maths.py` compares the two).
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
    L = min(L, c |A|) where A < 0; w = exp(l_prox - l_behav) without gradient, 0 where w > cap; without the
    decoupled loss l_prox = l_behav (so w = 1).

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
