"""Packing rows into one sequence, splitting a batch into micro-batches, and the attention that makes packing pay.

Design decisions, and why
- Micro-batches are packed: the rows of a micro-batch are unpadded and concatenated into one row whose
  `position_ids` restart at 0 for each sequence (`pack_rows`), and the sequence boundaries are passed to the model
  as `cu_seq_lens_q/k` (the flash-attention varlen arguments, `packed_forward`). RL batches are ragged (most
  responses short, a few at the length cap), so padding would spend much of the compute on pad tokens
  (`bench/packing.py` measures the difference).
- With flash attention (GPU) transformers uses the boundaries directly. Plain sdpa would turn the restarting
  position ids into a dense block-diagonal [T, T] mask, which on CPU means the slow masked kernel and attention work
  quadratic in the whole packed row; so sdpa models are switched to the `packed_sdpa` attention registered here
  (`register_packed_sdpa`): per sequence of the packed row it calls sdpa with `is_causal=True` (the fused kernel, no
  mask, work = sum of squared sequence lengths). Calls without `cu_seq_lens_q` (a padded batch) fall through to
  transformers' own sdpa with its usual mask. `tests/test_actor.py` checks packed log-probs equal per-sequence ones.
- Shared prompts (`share_prompts`): sequences whose prompts (the tokens before the first policy token) are equal
  keep one copy of it in the packed row; each remainder becomes a segment that attends to the whole copy and to
  itself causally (an explicit [t, prompt + t] mask, the one place a mask is built), so a GRPO group of n samples
  runs its prompt once instead of n times. Position ids are kept, so every token is computed as in the plain row.
  The layout travels to the attention as a model keyword (`shared_prefix_segments`), which transformers passes
  through to every attention call.
- Rows go into micro-batches by first-fit-decreasing under `mb_spec.max_tokens_per_mb`, with at least
  `mb_spec.n_mbs` micro-batches (`split_into_microbatches`): longest rows first fill the bins evenly. A row longer
  than the budget gets a micro-batch of its own; it is never split, since a cut sequence would lose the context its
  later tokens are conditioned on.
- AReaL hands the trainer a list of trajectories, each padded to its own length. `join_trajectories` makes them one
  right-padded batch (normalisation and packing must see the whole batch at once) and `split_trajectories` cuts a
  result back to each trajectory's rows and length. Index-like keys become int64 (`cast_long`): AReaL's batches
  hold int32, while embedding, gather and masks want long.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from areal_lite.api.cli_args import MicroBatchSpec
from areal_lite.utils.data import concat_padded_tensors

__all__ = [
    "PACKED_SDPA",
    "packed_sdpa_attention",
    "register_packed_sdpa",
    "split_into_microbatches",
    "pack_rows",
    "packed_forward",
    "share_prompts",
    "shared_prefix_forward",
    "SharedPrefixRow",
    "cast_long",
    "as_long",
    "join_trajectories",
    "split_trajectories",
]

PACKED_SDPA = "packed_sdpa"
SHARED_PREFIX_KW = "shared_prefix_segments"  # the model kwarg that carries a SharedPrefixRow's segments
INT_KEYS = ("input_ids", "loss_mask", "versions")


# ----------------------------------------------------------------------------------------------------------------
# Packed attention for sdpa (CPU, or GPU without flash attention)


def packed_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention function: causal sdpa per sequence of a packed row (see the module docstring)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    segments = kwargs.pop(SHARED_PREFIX_KW, None)
    cu = kwargs.pop("cu_seq_lens_q", None)
    for k in ("cu_seq_lens_k", "max_length_q", "max_length_k"):
        kwargs.pop(k, None)
    if segments is not None:
        return _shared_prefix_attention(module, query, key, value, segments, dropout, scaling, **kwargs), None
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


def _shared_prefix_attention(module, query, key, value, segments, dropout, scaling, **kwargs) -> torch.Tensor:
    """Attention of a `SharedPrefixRow`: each segment's queries see its prefix (whole) and itself (causally)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    outs = []
    for seg in segments:
        a, b = seg.start, seg.end
        if seg.mask is None:  # a segment without prefix: plain causal attention, the fused kernel
            out, _ = sdpa_attention_forward(
                module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None,
                dropout=dropout, scaling=scaling, is_causal=True, **kwargs,
            )  # fmt: skip
        else:
            pa, pb = seg.prefix
            k = torch.cat([key[:, :, pa:pb], key[:, :, a:b]], dim=2)
            v = torch.cat([value[:, :, pa:pb], value[:, :, a:b]], dim=2)
            out, _ = sdpa_attention_forward(
                module, query[:, :, a:b], k, v, seg.mask, dropout=dropout, scaling=scaling, is_causal=False, **kwargs
            )
        outs.append(out)  # [1, t, heads, head_dim]
    return torch.cat(outs, dim=1)


def register_packed_sdpa() -> None:
    """Make `attn_implementation="packed_sdpa"` known to transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_SDPA, sdpa_mask)  # non-packed calls get sdpa's usual masks


# ----------------------------------------------------------------------------------------------------------------
# Micro-batches and packed rows


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


def pack_rows(
    batch: Dict[str, torch.Tensor], rows: Sequence[int], keys: Sequence[str], device: torch.device
) -> Dict[str, torch.Tensor]:
    """Unpad `rows` of a right-padded batch and concatenate them into one row with restarting position ids.

    Returns `input_ids`, `position_ids`, `seq_start` (True where a sequence begins) and every key of `keys`, each a
    1-D tensor of the packed length on `device`.
    """
    valid = batch["attention_mask"].bool()
    ids, pos, out = [], [], {k: [] for k in keys}
    for i in rows:
        v = valid[i]
        n = int(v.sum())
        ids.append(batch["input_ids"][i][v])
        pos.append(torch.arange(n))
        for k in keys:
            out[k].append(batch[k][i][v])
    position_ids = torch.cat(pos)
    packed = {k: torch.cat(vs).to(device) for k, vs in out.items()}
    packed["input_ids"] = torch.cat(ids).long().to(device)
    packed["position_ids"] = position_ids.to(device)
    packed["seq_start"] = (position_ids == 0).to(device)
    return packed


def packed_forward(
    model: torch.nn.Module, packed: Dict[str, torch.Tensor], keep: Optional[torch.Tensor] = None
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


# ----------------------------------------------------------------------------------------------------------------
# Shared prompts: a GRPO group's prompt computed once


@dataclass
class Segment:
    """A run of a `SharedPrefixRow`: tokens [start, end) that attend to the tokens `prefix` = [pa, pb) (all of
    them) and to themselves causally; `mask` is that [1, 1, end - start, pb - pa + end - start] boolean mask, None
    without a prefix (plain causal attention)."""

    start: int
    end: int
    prefix: Tuple[int, int] = (0, 0)
    mask: Optional[torch.Tensor] = None


@dataclass
class SharedPrefixRow:
    """A packed row rewritten so that sequences with the same prompt share one copy of it (`share_prompts`).

    `input_ids` and `position_ids` [N] are the new row; `segments` its attention layout; `pred_of` [T] maps each
    position t of the original packed row to the position of the new row whose logits predict token t (-1 where
    nothing does: a sequence's first token)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    segments: List[Segment]
    pred_of: torch.Tensor


def share_prompts(packed: Dict[str, torch.Tensor], policy: torch.Tensor) -> Optional[SharedPrefixRow]:
    """The packed row with each distinct prompt once, or None when no two sequences share one.

    A sequence's prompt is everything before its first policy token (`policy`, the loss mask of the packed row);
    sequences whose prompts are equal token for token (a GRPO group's samples) keep one copy of it, and each one's
    remainder attends to that copy. Every token keeps its position id, so the logits that predict each token are
    those of the original row (up to float rounding).
    """
    ids = packed["input_ids"]
    T = ids.shape[0]
    bounds = torch.nonzero(packed["seq_start"]).flatten().tolist() + [T]
    pol, ids_l = policy.bool().tolist(), ids.tolist()
    groups: Dict[tuple, List[Tuple[int, int, int]]] = {}
    for a, b in zip(bounds[:-1], bounds[1:]):
        f = next((t for t in range(a + 1, b) if pol[t]), b)  # the first policy token (b: none)
        groups.setdefault(tuple(ids_l[a:f]), []).append((a, f, b))
    if len(groups) == len(bounds) - 1:
        return None
    take, segments, pred_of, n = [], [], [-1] * T, 0
    for members in groups.values():
        a0, f0, _ = members[0]
        p0, P = n, f0 - a0
        take.append((a0, f0))
        segments.append(Segment(p0, p0 + P))
        n += P
        for a, f, b in members:
            pred_of[a + 1 : f] = range(p0, p0 + P - 1)
            if f == b:
                continue
            L = b - f
            take.append((f, b))
            mask = torch.ones(L, P + L, dtype=torch.bool, device=ids.device).tril(P).view(1, 1, L, P + L)
            segments.append(Segment(n, n + L, (p0, p0 + P), mask))
            pred_of[f:b] = [p0 + P - 1, *range(n, n + L - 1)]
            n += L
    index = torch.cat([torch.arange(a, b) for a, b in take]).to(ids.device)
    return SharedPrefixRow(
        input_ids=ids[index],
        position_ids=packed["position_ids"][index],
        segments=segments,
        pred_of=torch.tensor(pred_of, dtype=torch.long, device=ids.device),
    )


def shared_prefix_forward(model: torch.nn.Module, row: SharedPrefixRow, keep: torch.Tensor) -> torch.Tensor:
    """Logits [len(keep), V] at the positions `keep` of a `SharedPrefixRow` (the `packed_sdpa` attention only)."""
    out = model(
        input_ids=row.input_ids.unsqueeze(0),
        position_ids=row.position_ids.unsqueeze(0),
        use_cache=False,
        logits_to_keep=keep,
        **{SHARED_PREFIX_KW: row.segments},
    )
    return out.logits[0]


# ----------------------------------------------------------------------------------------------------------------
# AReaL's list of trajectories <-> one batch


def cast_long(batch: Dict[str, torch.Tensor]) -> None:
    """Index-like keys as int64 in place (AReaL's batches hold int32; embedding, gather and masks want long)."""
    for key in INT_KEYS:
        if key in batch and batch[key].dtype != torch.long:
            batch[key] = batch[key].long()


def as_long(batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """A shallow copy of `batch` with `cast_long` applied: the caller's dict is left as it was."""
    out = dict(batch)
    cast_long(out)
    return out


def join_trajectories(items: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """AReaL's list of trajectories as one right-padded batch (normalisation and packing see them all at once)."""
    if not items:
        raise ValueError("an empty list of trajectories: nothing to train on (did every rollout fail or get rejected?)")
    joined = concat_padded_tensors(items)
    cast_long(joined)
    return joined


def split_trajectories(t: torch.Tensor, items: List[Dict[str, torch.Tensor]]) -> List[torch.Tensor]:
    """Per-trajectory slices of a joined [B, L] (or per-row [B]) tensor, cut back to each one's rows and length."""
    out, row = [], 0
    for item in items:
        rows, length = item["input_ids"].shape
        out.append(t[row : row + rows] if t.dim() == 1 else t[row : row + rows, :length])
        row += rows
    return out
