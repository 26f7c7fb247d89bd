"""Packing rows into one sequence, splitting a batch into micro-batches, and the attention that makes packing pay.

Design decisions, and why
- Micro-batches are packed: a micro-batch's rows are unpadded and concatenated into one row whose `position_ids`
  restart at 0 for each sequence (`pack_rows`); the boundaries reach the model as `cu_seq_lens_q/k` (flash
  attention's varlen arguments, `packed_forward`). RL batches are ragged, so padding would spend much of the compute
  on pad tokens (`bench/packing.py` measures the difference).
- With flash attention (GPU) transformers uses the boundaries directly. Plain sdpa would build a dense block-diagonal
  [T, T] mask (on CPU the slow masked kernel, work quadratic in the packed row), so sdpa models get the `packed_sdpa`
  attention registered here (`packed_sdpa_attention`). `tests/test_actor.py` checks packed log-probs equal
  per-sequence ones.
- Shared prompts (`share_prompts`): sequences with equal prompts keep one copy of it in the packed row, so a GRPO
  group of n samples runs its prompt once, not n times; position ids are kept, so every token is computed as in the
  plain row. Micro-batches keep a group together (`prompt_groups`) unless it exceeds the token budget alone, and the
  budget counts its prompt once.
- Rows go into micro-batches longest first, each into the least-loaded one it fits under `max_tokens_per_mb`, at
  least `n_mbs` of them (`split_into_microbatches`). A row over the budget gets a micro-batch of its own and is never
  split: a cut sequence would lose the context its later tokens are conditioned on.
- AReaL hands the trainer a list of trajectories: `join_trajectories` makes them one right-padded batch and
  `split_trajectories` cuts results back. Index-like keys become int64 (`cast_long`): AReaL's hold int32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from areal_lite.api.cli_args import MicroBatchSpec
from areal_lite.engine.fsdp_utils.embedding_grad import embedding_inputs
from areal_lite.utils.data import concat_padded_tensors
from areal_lite.utils.prefix import common_start

__all__ = [
    "PACKED_SDPA",
    "packed_sdpa_attention",
    "register_packed_sdpa",
    "split_into_microbatches",
    "prompt_groups",
    "prompt_end",
    "row_prompt",
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
SHARED_PREFIX_KW = "shared_prefix_row"  # the model kwarg that carries a SharedPrefixRow's attention layout
# Distinct prompts share their common start only when that saves at least this many tokens: it costs a third
# attention call per layer, not worth it for a token or two (a judgement, not a measurement; the demo saves 81).
COMMON_START_MIN_SAVED = 16
INT_KEYS = ("input_ids", "loss_mask", "versions")


# ----------------------------------------------------------------------------------------------------------------
# Packed attention for sdpa (CPU, or GPU without flash attention)


def packed_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention function: causal sdpa per sequence of a packed row.

    Per sequence of the packed row (`cu_seq_lens_q`) it calls sdpa with `is_causal=True`: the fused kernel, no mask,
    work = the sum of squared sequence lengths. A `SharedPrefixRow` layout (the `shared_prefix_row` keyword, which
    transformers passes through to every attention call) goes to `_shared_prefix_attention`. Calls without
    `cu_seq_lens_q` (a padded batch) fall through to transformers' own sdpa with its usual mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        # Attention in float32 under a CPU's bf16 autocast, which would hand sdpa bf16 inputs: a CPU's bf16 sdpa
        # backward runs several times slower than its float32 one, even with AMX, and attention is a small share
        # of the FLOPs (bench/update_speed.py's bf16 rows time the whole update).
        with torch.autocast("cpu", enabled=False):
            return packed_sdpa_attention(
                module, query.float(), key.float(), value.float(), attention_mask, dropout, scaling, **kwargs
            )
    shared = kwargs.pop(SHARED_PREFIX_KW, None)
    cu = kwargs.pop("cu_seq_lens_q", None)
    for k in ("cu_seq_lens_k", "max_length_q", "max_length_k"):
        kwargs.pop(k, None)
    if shared is not None:
        return _shared_prefix_attention(module, query, key, value, shared, dropout, scaling, **kwargs), None
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


def _shared_prefix_attention(module, query, key, value, layout, dropout, scaling, **kwargs) -> torch.Tensor:
    """Attention of a `SharedPrefixRow`: one sdpa call per bucket of segments, gathered into a padded batch.

    The buckets have explicit masks, the one place masks are built: a few sdpa calls per layer instead of one per
    sequence, since per-sequence slices cost a zero-filled gradient buffer each in the backward."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        # [1, heads, N, d] -> [segments, heads, Q or K, d]. index_select, not x[0][:, idx]: a shared prompt's keys
        # are gathered by many segments, and indexing's backward sums their gradients with parallel atomic adds
        # on a CPU, in an order that changes from run to run (two same-seed runs part after a few steps);
        # index_select's backward adds them one index at a time.
        return x[0].index_select(1, idx.flatten()).unflatten(1, idx.shape).transpose(0, 1)

    # Grouped heads on a CPU: sdpa's own `enable_gqa`, bit for bit what transformers' `repeat_kv` gives (it uses that
    # only without a mask), without copying every key and value once per query head (SmolLM2: 9 heads over 3) and
    # summing their gradients back, in every layer of every update.
    gqa = query.device.type == "cpu" and query.shape[1] != key.shape[1]
    outs = []
    for bucket in layout.buckets:
        q, k, v = gather(query, bucket.q_idx), gather(key, bucket.k_idx), gather(value, bucket.k_idx)
        if gqa:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=bucket.mask, dropout_p=dropout, scale=scaling, enable_gqa=True
            ).transpose(1, 2)  # [segments, Q, heads, d], as sdpa_attention_forward returns it
        else:
            out, _ = sdpa_attention_forward(module, q, k, v, bucket.mask, dropout=dropout, scaling=scaling,
                                            is_causal=False, **kwargs)  # fmt: skip
        outs.append(out.flatten(0, 1))  # [segments * Q, heads, d]
    # index_select, not [out_idx]: each position is picked once, and indexing's backward (an accumulating
    # index_put) is many times slower on a CPU than index_select's index_add, which gives the same sums exactly.
    return torch.cat(outs).index_select(0, layout.out_idx).unsqueeze(0)


def register_packed_sdpa() -> None:
    """Make `attn_implementation="packed_sdpa"` known to transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_SDPA, sdpa_mask)  # non-packed calls get sdpa's usual masks


# ----------------------------------------------------------------------------------------------------------------
# Micro-batches and packed rows


def split_into_microbatches(lengths: Sequence[int], mb_spec: MicroBatchSpec) -> List[List[int]]:
    """Row indices per micro-batch: longest row first, each into the least-loaded bin it fits under the token budget,
    at least `n_mbs` bins.

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


def prompt_groups(prompts: Sequence[tuple], lengths: Sequence[int], budget: float) -> List[Tuple[List[int], int]]:
    """Rows with equal prompts as items for `split_into_microbatches`: (row indices, tokens once the prompt is
    shared). A group whose shared size exceeds `budget` is cut into consecutive parts that fit (a part holds at
    least one row), each part keeping its own copy of the prompt."""
    by_prompt: Dict[tuple, List[int]] = {}
    for i, prompt in enumerate(prompts):
        by_prompt.setdefault(prompt, []).append(i)
    items = []
    for prompt, rows in by_prompt.items():
        P = len(prompt)
        part, size = [], P
        for i in rows:
            if part and size + lengths[i] - P > budget:
                items.append((part, size))
                part, size = [], P
            part.append(i)
            size += lengths[i] - P
        items.append((part, size))
    return items


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
        **embedding_inputs(model, packed["input_ids"].unsqueeze(0)),
        position_ids=packed["position_ids"].unsqueeze(0),
        cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
        max_length_q=max_len,
        max_length_k=max_len,
        use_cache=False,
        logits_to_keep=0 if keep is None else keep,
    )
    # squeeze, not [0]: the backward of a view is a view, while select's fills a zeroed [1, K, V] gradient and
    # copies into it (K x V is 25M floats for the demo's batch: 100 MB zeroed and copied in each update).
    return out.logits.squeeze(0)


# ----------------------------------------------------------------------------------------------------------------
# Shared prompts: a GRPO group's prompt computed once


@dataclass
class AttentionBucket:
    """Segments of a `SharedPrefixRow` attended in one sdpa call: segment i's queries are the row positions
    `q_idx[i]` and its keys `k_idx[i]` (its prefix, then itself), both padded to the bucket's widest; `mask`
    [S, 1, Q, K] lets each query see the whole prefix and itself causally (a padding query sees one key, so that
    no softmax row is empty; its output is never read). A segment's prefix is one or two stretches of the row (the
    prompts' common start, then its own prompt), gathered by `k_idx`."""

    q_idx: torch.Tensor
    k_idx: torch.Tensor
    mask: torch.Tensor


@dataclass
class SharedPrefixRow:
    """A packed row rewritten so that sequences with the same prompt share one copy of it (`share_prompts`).

    `input_ids` and `position_ids` [N] are the new row (without each sequence's last token). Its attention: the
    prompts' common start causally (when there is one), each prompt's rest over that start and itself causally, each
    remainder over its whole prompt and itself causally, in `buckets` (common start, prompts, remainders); `out_idx`
    [N] picks each position's output from the buckets' outputs, flattened and concatenated. `pred_of` [T] maps each
    position t of the original packed row to the position of the new row whose logits predict token t (-1 where
    nothing does: a sequence's first token)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    buckets: List[AttentionBucket]
    out_idx: torch.Tensor
    pred_of: torch.Tensor


Segment = Tuple[List[Tuple[int, int]], int, int]  # (prefix: stretches [start, end) of the row, start, end)


def _bucket(segments: List[Segment], offset: int, out_idx: List[int], device) -> AttentionBucket:
    """One `AttentionBucket` of segments (prefix stretches, start, end); fills `out_idx` for their positions,
    their outputs starting at `offset` of the concatenated outputs."""
    Q = max(b - a for _, a, b in segments)
    K = max(sum(e - s for s, e in prefix) + b - a for prefix, a, b in segments)
    S = len(segments)
    q_idx = torch.zeros(S, Q, dtype=torch.long)
    k_idx = torch.zeros(S, K, dtype=torch.long)
    mask = torch.zeros(S, 1, Q, K, dtype=torch.bool)
    for i, (prefix, a, b) in enumerate(segments):
        P, L = sum(e - s for s, e in prefix), b - a
        q_idx[i] = a
        q_idx[i, :L] = torch.arange(a, b)
        k_idx[i] = a
        k_idx[i, : P + L] = torch.cat([*(torch.arange(s, e) for s, e in prefix), torch.arange(a, b)])
        mask[i, 0, :L, : P + L] = torch.ones(L, P + L, dtype=torch.bool).tril(P)
        mask[i, 0, L:, 0] = True  # padding queries: one key, never read
        out_idx[a:b] = range(offset + i * Q, offset + i * Q + L)
    return AttentionBucket(q_idx.to(device), k_idx.to(device), mask.to(device))


def prompt_end(policy: Sequence[bool], start: int, end: int) -> int:
    """Where the prompt of the sequence at positions [start, end) ends: at its first policy token (`end` if it has
    none). A sequence's first token is never predicted, so it never counts."""
    return next((t for t in range(start + 1, end) if policy[t]), end)


def row_prompt(batch: Dict[str, torch.Tensor], row: int) -> tuple:
    """A padded batch row's prompt: its tokens before the first one the loss covers (`prompt_end`)."""
    valid = int(batch["attention_mask"][row].sum())
    end = prompt_end(batch["loss_mask"][row, :valid].bool().tolist(), 0, valid)
    return tuple(batch["input_ids"][row, :end].tolist())


def share_prompts(packed: Dict[str, torch.Tensor], policy: torch.Tensor) -> Optional[SharedPrefixRow]:
    """The packed row with each distinct prompt once, or None when no two sequences share a prompt or a start.

    A sequence's prompt is everything before its first policy token (`policy`, the loss mask of the packed row);
    sequences whose prompts are equal token for token (a GRPO group's samples) keep one copy of it, and each one's
    remainder attends to that copy. Distinct prompts that begin alike (a chat template's system prompt) also keep
    one copy of their common start (`common_start`), which each prompt's rest attends to. Every token keeps its
    position id, so the logits that predict each token are those of the original row (up to float rounding).

    A sequence's last token is left out of the new row: nothing reads its output (no later token of its sequence
    attends to it, and its logits would predict the next sequence's first token), so running it through every
    layer, forward and backward, is work for nothing: one token per sequence, a noticeable share of an update whose
    answers are short.
    """
    ids = packed["input_ids"]
    T = ids.shape[0]
    bounds = torch.nonzero(packed["seq_start"]).flatten().tolist() + [T]
    pol, ids_l = policy.bool().tolist(), ids.tolist()
    groups: Dict[tuple, List[Tuple[int, int, int]]] = {}
    for a, b in zip(bounds[:-1], bounds[1:]):
        f = prompt_end(pol, a, b)
        groups.setdefault(tuple(ids_l[a:f]), []).append((a, f, b))
    c = common_start(list(groups), COMMON_START_MIN_SAVED)
    if len(groups) == len(bounds) - 1 and not c:
        return None
    take, levels, pred_of = [], [[], [], []], [-1] * T  # levels: common start, prompts' rests, remainders
    first = next(iter(groups.values()))[0][0]  # where the first sequence starts: its copy of the common start
    if c:
        take.append((first, first + c))
        levels[0].append(([], 0, c))
    n = c
    for members in groups.values():
        a0, f0, _ = members[0]
        rest = (n, n + f0 - a0 - c)  # this prompt's tokens after the common start
        take.append((a0 + c, f0))
        levels[1].append(([(0, c)] if c else [], *rest))
        n = rest[1]
        where = [*range(c), *range(*rest)]  # the new position of each of the prompt's tokens
        for a, f, b in members:
            pred_of[a + 1 : f] = where[:-1]
            if f < b:
                pred_of[f:b] = [where[-1], *range(n, n + b - f - 1)]
                if b - 1 > f:  # the remainder without its last token (see the docstring)
                    take.append((f, b - 1))
                    levels[2].append(([(0, c), rest] if c else [rest], n, n + b - 1 - f))
                    n += b - 1 - f
    out_idx, buckets = [0] * n, []
    for segments in filter(None, levels):
        offset = sum(bucket.q_idx.numel() for bucket in buckets)
        buckets.append(_bucket(segments, offset, out_idx, ids.device))
    index = torch.cat([torch.arange(a, b) for a, b in take]).to(ids.device)
    return SharedPrefixRow(
        input_ids=ids[index],
        position_ids=packed["position_ids"][index],
        buckets=buckets,
        out_idx=torch.tensor(out_idx, dtype=torch.long, device=ids.device),
        pred_of=torch.tensor(pred_of, dtype=torch.long, device=ids.device),
    )


def shared_prefix_forward(model: torch.nn.Module, row: SharedPrefixRow, keep: torch.Tensor) -> torch.Tensor:
    """Logits [len(keep), V] at the positions `keep` of a `SharedPrefixRow` (the `packed_sdpa` attention only).

    A shared position can predict several tokens (a group's prompt end predicts each sample's first token). The
    model's own pick of positions (indexing) would sum a repeated position's gradients with parallel atomic adds,
    in an order that changes from run to run on two threads. So the model picks each position once, and the LM
    head's input repeats them by `index_select`, whose backward adds them one index at a time: the sums the
    indexing makes when it happens to run in order."""
    positions, repeat = torch.unique(keep, return_inverse=True)
    handle = None
    if len(positions) < len(keep):
        head = model.get_output_embeddings()
        handle = head.register_forward_pre_hook(lambda _, args: (args[0].index_select(1, repeat), *args[1:]))
    try:
        out = model(
            **embedding_inputs(model, row.input_ids.unsqueeze(0)),
            position_ids=row.position_ids.unsqueeze(0),
            use_cache=False,
            logits_to_keep=keep if handle is None else positions,
            **{SHARED_PREFIX_KW: row},
        )
    finally:
        if handle is not None:
            handle.remove()
    return out.logits.squeeze(0)  # not [0]: see packed_forward


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
