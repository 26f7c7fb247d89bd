"""Batch helpers at AReaL 1.0.4's `areal.utils.data` path, with its names, signatures and results.

- Batches: `pad_sequences_to_tensors` (rows of lists -> one right-padded batch), `concat_padded_tensors` (padded
  batches of different lengths -> one), `pack_tensor_dict` / `unpack_sequence` (padding removed, rows end to end),
  `pad_and_stack_tensors_along_first_dim`, `reorder_list`, `tensor_container_to`.
- Micro-batches: `split_padded_tensor_dict_into_mb_list` cuts a padded batch into token-balanced micro-batches
  (first-fit-decreasing under `MicroBatchSpec.max_tokens_per_mb`) and returns a `MicroBatchList` whose
  forward/backward indices restore the original row order.
- `Normalization`: the reward/advantage normalisation of a `NormConfig` (the kit's `functional.normalize` is a
  thin wrapper over it, so there is one copy of the formula).
- `cycle_dataloader`: epoch after epoch, reshuffled (`itertools.cycle` would replay the first epoch's batches).

Kit differences, each where AReaL would fail later or silently: a rejected (None) row, a 0-d tensor or rows of
one dict with different batch sizes raise at once in `concat_padded_tensors`; group normalisation of a batch that
is not a whole number of groups raises (AReaL divides the leftover rows by eps); a dataloader that keeps yielding
nothing raises in `cycle_dataloader` instead of spinning forever.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

if TYPE_CHECKING:  # annotations only: utils sits below api, whose configs these read by attribute
    from areal_lite.api.cli_args import MicroBatchSpec, NormConfig


__all__ = [
    "MicroBatchItem",
    "MicroBatchList",
    "Normalization",
    "allocate_balanced_mbs",
    "allocate_balanced_mbs_synced",
    "concat_padded_tensors",
    "cycle_dataloader",
    "get_batch_size",
    "is_multi_modal_key",
    "pack_tensor_dict",
    "pad_and_stack_tensors_along_first_dim",
    "pad_sequences_to_tensors",
    "reorder_list",
    "split_padded_tensor_dict_into_mb_list",
    "tensor_container_to",
    "unpack_sequence",
]

DEFAULT_MAX_TOKENS_PER_MB = 10**12  # AReaL's token budget when MicroBatchSpec.max_tokens_per_mb is None


# ------------------------------------------------------------------------------------------------ small helpers


def is_multi_modal_key(key: str) -> bool:
    """`multi_modal_input*` keys hold per-row lists (images), not padded tensors."""
    return key.startswith("multi_modal_input")


def get_batch_size(data: dict[str, Any]) -> int:
    """Rows of a batch dict: from attention_mask, else cu_seqlens, else a multimodal list, else any tensor."""
    if not data:
        return 0
    am, cu, mmi = data.get("attention_mask"), data.get("cu_seqlens"), data.get("multi_modal_input")
    if torch.is_tensor(am) and am.ndim >= 1:
        return int(am.shape[0])
    if torch.is_tensor(cu) and cu.ndim >= 1 and cu.numel() >= 1:
        return max(int(cu.shape[0]) - 1, 0)
    if isinstance(mmi, list):
        return len(mmi)
    return next((int(v.shape[0]) for v in data.values() if torch.is_tensor(v) and v.ndim >= 1), 0)


def reorder_list(xs: Sequence, indices: list[int]) -> list:
    """`[xs[i] for i in indices]`; `indices` must name every item once (AReaL raises AssertionError otherwise)."""
    if len(set(indices)) != len(xs):
        raise AssertionError(f"reorder_list: {len(set(indices))} distinct indices for {len(xs)} items")
    return [xs[i] for i in indices]


def tensor_container_to(
    d: dict[str, Any] | torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...], *args, **kwargs
):
    """`t.to(*args, **kwargs)` on every tensor of a (nested) dict or list; a tuple comes back as a list, as in
    AReaL; other values unchanged."""
    if torch.is_tensor(d):
        return d.to(*args, **kwargs)
    if isinstance(d, (list, tuple)):
        return [tensor_container_to(v, *args, **kwargs) for v in d]
    if isinstance(d, dict):
        return {k: tensor_container_to(v, *args, **kwargs) for k, v in d.items()}
    return d


def _pad_to(t: torch.Tensor, shape: Sequence[int], fill: float) -> torch.Tensor:
    """`t` right-padded with `fill` to `shape` (every dimension at least as large as t's)."""
    if tuple(t.shape) == tuple(shape):
        return t
    out = torch.full(tuple(shape), fill, dtype=t.dtype, device=t.device)
    out[tuple(slice(0, n) for n in t.shape)] = t
    return out


def pad_and_stack_tensors_along_first_dim(tensor_list: list[torch.Tensor]):
    """Right-pad each tensor's first dimension with 0 to the longest and stack them: `[n, max_len, ...]`."""
    max_length = max(t.shape[0] for t in tensor_list)
    n_dim = tensor_list[0].ndim
    if any(t.ndim != n_dim for t in tensor_list):
        raise ValueError("All tensors must have the same number of dimensions.")
    return torch.stack([_pad_to(t, (max_length, *t.shape[1:]), 0) for t in tensor_list], dim=0)


# ------------------------------------------------------------------------------------------------ padded batches


def pad_sequences_to_tensors(sequence_list: list[dict[str, Any]], pad_value: float = 0.0) -> dict[str, Any]:
    """Rows of 1-D sequences (lists or tensors) -> `[B, max_len]` tensors right-padded with `pad_value`, plus a
    bool `attention_mask` from each row's first non-multimodal key. Multimodal keys: the rows' lists joined."""
    if not sequence_list:
        return {}
    max_length = max(len(seq) for row in sequence_list for k, seq in row.items() if not is_multi_modal_key(k))
    result: dict[str, Any] = {}
    for key in sequence_list[0]:
        if is_multi_modal_key(key):
            result[key] = [
                {k: v if torch.is_tensor(v) else torch.tensor(v) for k, v in item.items()}
                for row in sequence_list
                for item in row[key]
            ]
            continue
        rows = [row[key] if torch.is_tensor(row[key]) else torch.tensor(row[key]) for row in sequence_list]
        result[key] = torch.stack([_pad_to(r, (max_length, *r.shape[1:]), pad_value) for r in rows])
    lengths = [len(next(v for k, v in row.items() if not is_multi_modal_key(k))) for row in sequence_list]
    result["attention_mask"] = torch.arange(max_length) < torch.tensor(lengths).unsqueeze(1)
    return result


def _check_concat_inputs(tensor_dicts: Sequence[Any]) -> None:
    """The kit's early errors: a None row (a rejected episode), different keys, a tensor without a batch
    dimension, or tensors of one dict with different batch sizes."""
    for i, d in enumerate(tensor_dicts):
        if not isinstance(d, dict):
            raise TypeError(
                f"concat_padded_tensors: item {i} is {type(d).__name__}, expected dict[str, Tensor] "
                "(filter out rejected episodes, which return None, first)"
            )
    keys = set(tensor_dicts[0])
    for i, d in enumerate(tensor_dicts[1:], start=1):
        if set(d) != keys:
            missing, extra = sorted(keys - set(d)), sorted(set(d) - keys)
            raise ValueError(
                f"concat_padded_tensors: item {i} has different keys than item 0 (missing {missing}, extra {extra})"
            )
    for i, d in enumerate(tensor_dicts):
        tensors = {k: v for k, v in d.items() if torch.is_tensor(v)}
        bad = [k for k, v in tensors.items() if v.dim() == 0]
        if bad:
            raise ValueError(f"concat_padded_tensors: item {i} keys {bad} are not tensors with a batch dimension")
        sizes = {k: v.shape[0] for k, v in tensors.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"concat_padded_tensors: item {i} has keys with different batch sizes: {sizes}")


def concat_padded_tensors(
    tensor_dicts: list[dict[str, Any]], pad_value: float = 0.0, *, pad_token_id: Optional[int] = None
) -> dict[str, Any]:
    """Concatenate batch dicts on dim 0, right-padding every other dimension of a tensor to the largest (AReaL's).

    Tensors: padded with `pad_value` (attention_mask with False; kit extra: input_ids with `pad_token_id` when
    given), then concatenated; 1-D tensors (`rewards` [b]) just concatenated. Lists: joined. `multi_modal_input*`
    lists: joined row by row. Any other value: item 0's. An empty list gives `{}`, one dict a shallow copy.
    """
    if not tensor_dicts:
        return {}
    _check_concat_inputs(tensor_dicts)
    if len(tensor_dicts) == 1:
        return dict(tensor_dicts[0])
    result: dict[str, Any] = {}
    for key in tensor_dicts[0]:
        if is_multi_modal_key(key):
            result[key] = [row for d in tensor_dicts for row in d.get(key, [{}] * get_batch_size(d))]
    for key in tensor_dicts[0]:
        if key in result:
            continue
        values = [d[key] for d in tensor_dicts]
        if torch.is_tensor(values[0]):
            dims = {v.dim() for v in values}
            if len(dims) != 1:
                raise ValueError(f"concat_padded_tensors: key {key!r} has different numbers of dimensions {dims}")
            fill = 0 if key == "attention_mask" else pad_value
            if key == "input_ids" and pad_token_id is not None:
                fill = pad_token_id
            tail = [max(v.shape[d] for v in values) for d in range(1, values[0].dim())]
            result[key] = torch.cat([_pad_to(v, (v.shape[0], *tail), fill) for v in values], dim=0)
        elif isinstance(values[0], list):
            result[key] = [item for v in values for item in v]
        else:
            result[key] = values[0]
    return result


def pack_tensor_dict(data: dict[str, Any]) -> dict[str, Any]:
    """Right-padded `[B, S, ...]` tensors -> `[total_tokens, ...]` (each row's first `len_i` positions, end to end).

    attention_mask `[B, S]` is replaced by `cu_seqlens` (int32 `[B+1]`) and `max_seqlen` (int); keys that are not
    `[B, S, ...]` tensors are kept as they are.
    """
    if "attention_mask" not in data:
        raise AssertionError("Input data must contain 'attention_mask' key.")
    attention_mask = data["attention_mask"]
    if attention_mask.ndim != 2:
        raise AssertionError("Attention mask must be a 2D tensor.")
    bs, seq_len = attention_mask.shape
    lens = attention_mask.sum(dim=1, dtype=torch.int32)
    cu_seqlens = F.pad(torch.cumsum(lens, dim=0, dtype=torch.int32), (1, 0), value=0)
    keep = torch.arange(seq_len, device=lens.device) < lens.unsqueeze(1)  # row i's first len_i positions
    packed: dict[str, Any] = {}
    for key, value in data.items():
        if key == "attention_mask":
            packed["cu_seqlens"] = cu_seqlens
            packed["max_seqlen"] = int(lens.max().item())
        elif torch.is_tensor(value) and value.ndim >= 2 and tuple(value.shape[:2]) == (bs, seq_len):
            packed[key] = value[keep.to(value.device)]
        else:
            packed[key] = value
    return packed


def unpack_sequence(
    x: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None, lens: Optional[list[int]] = None, dim: int = 0
):
    """Split a packed tensor along `dim` into its sequences, by `lens` or else by `cu_seqlens` (a tuple)."""
    if lens is not None:
        return torch.split(x, lens, dim=dim)
    if cu_seqlens is not None:
        return torch.split(x, (cu_seqlens[1:] - cu_seqlens[:-1]).cpu().tolist(), dim=dim)
    raise ValueError("Either cu_seqlens or input_lens must be provided.")


# ------------------------------------------------------------------------------------------------ micro-batches


def _ffd_groups(values: np.ndarray, capacity: int, min_groups: int) -> list[list[int]]:
    """First fit decreasing: longest first; open a group while fewer than `min_groups` exist or nothing fits, else
    add to the fitting group holding the fewest items (ties: the lightest). AReaL's tie rules, so equal inputs give
    equal micro-batches."""
    groups: list[list[int]] = []
    loads: list[tuple[float, int]] = []  # (load, group), kept sorted
    for idx in np.argsort(-values):  # numpy's own tie order, as AReaL's
        v = int(values[idx])
        if len(loads) < min_groups or loads[0][0] + v > capacity:
            bisect.insort(loads, (float(v), len(groups)))
            groups.append([int(idx)])
            continue
        fitting = [k for k, (load, _) in enumerate(loads) if load <= capacity - v]
        k = min(fitting, key=lambda j: (len(groups[loads[j][1]]), j))
        load, g = loads.pop(k)
        bisect.insort(loads, (load + v, g))
        groups[g].append(int(idx))
    return groups


def allocate_balanced_mbs(mb_spec: MicroBatchSpec, lens: list[int]) -> list[list[int]]:
    """Indices of `lens` per micro-batch: at most `max_tokens_per_mb` tokens each, at least `n_mbs` micro-batches,
    a multiple of `n_mbs_divisor` of them; sorted. RuntimeError when no split satisfies all three. The kit packs
    with FFD whatever `packing_algorithm` says."""
    capacity = mb_spec.max_tokens_per_mb
    if capacity is None:
        raise AssertionError("allocate_balanced_mbs needs mb_spec.max_tokens_per_mb")
    values = np.asarray(lens, dtype=np.int64).reshape(-1)
    divisor = mb_spec.n_mbs_divisor
    min_groups = divisor if mb_spec.n_mbs is None or mb_spec.n_mbs < divisor else mb_spec.n_mbs
    if (values > capacity).any():
        raise RuntimeError(f"Values {values.tolist()} is larger than capacity {capacity}")
    if len(values) < min_groups:
        raise RuntimeError(f"Number of values {len(values)} is smaller than min_groups {min_groups}")
    while True:
        groups = _ffd_groups(values, capacity, min_groups)
        min_groups += divisor - min_groups % divisor
        if len(groups) % divisor == 0:
            return sorted(sorted(g) for g in groups)
        if len(values) < min_groups:
            raise RuntimeError(
                f"Cannot allocate values {values.tolist()} that satisfies capacity {capacity}, "
                f"min_groups {min_groups} and n_groups_divisor {divisor}."
            )


def allocate_balanced_mbs_synced(
    mb_spec: MicroBatchSpec, lens: list[int], group: Optional[Any] = None
) -> list[list[int]]:
    """`allocate_balanced_mbs`, re-run with the largest count of any rank so every rank has as many micro-batches."""
    groups = allocate_balanced_mbs(mb_spec, lens)
    if not (dist.is_available() and dist.is_initialized()):
        return groups
    counts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(counts, len(groups), group=group)
    if all(c == len(groups) for c in counts):
        return groups
    return allocate_balanced_mbs_synced(dataclasses.replace(mb_spec, n_mbs=max(counts)), lens, group)


class MicroBatchItem(NamedTuple):
    """One micro-batch of a `MicroBatchList` walk: the original dict, the padded one the model sees, the batch-level
    padding added, the cu_seqlens before sequence alignment and the length padded to (None when not padded)."""

    orig_mb: dict[str, Any]
    padded_mb: dict[str, Any]
    padding_length: int
    old_cu_seqlens: Optional[torch.Tensor]
    padded_to_length: Optional[int] = None


@dataclass
class MicroBatchList:
    """Micro-batches of one batch (AReaL's fields): `mbs[k]` holds rows `forward_indices[...]` of `data`; putting
    the concatenated rows back in `backward_indices` order restores `data`'s order. `group_lens[k]`: its tokens.
    The padding fields are filled by AReaL's engines before iterating; the kit's engine packs its own way."""

    data: dict[str, Any]
    mb_spec: MicroBatchSpec
    mbs: list[dict[str, Any]]
    group_lens: list[int]
    forward_indices: Optional[list[int]] = None
    backward_indices: Optional[list[int]] = None
    padded_mbs: Optional[list[dict[str, Any]]] = None
    _max_seqlen: Optional[int] = None
    padding_lengths: Optional[list[int]] = None
    padded_to_lengths: Optional[list[int]] = None
    align_to_lengths: Optional[list[int]] = None
    old_cu_seqlens_list: Optional[list[torch.Tensor]] = None

    def _require_padded(self) -> list[dict[str, Any]]:
        if self.padded_mbs is None:
            raise ValueError("padded_mbs is None. Call pad_mb_list first.")
        return self.padded_mbs

    @property
    def max_seqlen(self) -> int:
        """Tokens of the longest padded micro-batch (its last cu_seqlens entry)."""
        padded = self._require_padded()
        if self._max_seqlen is None:
            if not all("cu_seqlens" in m for m in padded):
                raise AssertionError("cu_seqlens not found in some padded micro-batches.")
            self._max_seqlen = max(int(m["cu_seqlens"][-1].item()) for m in padded)
        return self._max_seqlen

    def __len__(self) -> int:
        return len(self.mbs)

    def __iter__(self) -> Iterator[MicroBatchItem]:
        padded = self._require_padded()
        for i, mb in enumerate(self.mbs):
            yield MicroBatchItem(
                orig_mb=mb,
                padded_mb=padded[i],
                padding_length=self.padding_lengths[i],
                old_cu_seqlens=self.old_cu_seqlens_list[i] if self.old_cu_seqlens_list else None,
                padded_to_length=self.padded_to_lengths[i] if self.padded_to_lengths else None,
            )

    def to(self, *args, **kwargs) -> "MicroBatchList":
        """A copy with every tensor moved/cast by `t.to(*args, **kwargs)`."""
        moved = {
            "data": tensor_container_to(self.data, *args, **kwargs),
            "mbs": [tensor_container_to(mb, *args, **kwargs) for mb in self.mbs],
        }
        if self.padded_mbs is not None:
            moved["padded_mbs"] = [tensor_container_to(mb, *args, **kwargs) for mb in self.padded_mbs]
        if self.old_cu_seqlens_list is not None:
            moved["old_cu_seqlens_list"] = [t.to(*args, **kwargs) for t in self.old_cu_seqlens_list]
        return dataclasses.replace(self, **moved)


def split_padded_tensor_dict_into_mb_list(
    data: dict[str, Any], mb_spec: MicroBatchSpec, group: Optional[Any] = None
) -> MicroBatchList:
    """Cut a right-padded batch into micro-batches of whole rows, balanced by tokens (`allocate_balanced_mbs`).

    Rows are kept together in runs of `mb_spec.granularity` (a group's samples). `position_ids` and every tensor
    with B * S elements are split by rows; `multi_modal_input*` lists by rows too; anything else is copied into
    every micro-batch. Under torch.distributed every rank of `group` gets the same number of micro-batches.
    """
    if "attention_mask" not in data:
        raise ValueError("Input data must be padded and contain 'attention_mask' key.")
    if mb_spec.max_tokens_per_mb is None:
        mb_spec = dataclasses.replace(mb_spec, max_tokens_per_mb=DEFAULT_MAX_TOKENS_PER_MB)
    granularity = mb_spec.granularity
    mask = data["attention_mask"]
    bs, max_seqlen = mask.shape[0], mask.shape[1]
    if bs % granularity != 0:
        raise RuntimeError(f"Batch size {bs} cannot divide granularity {granularity}.")
    seq_lens = mask.sum(1).long().cpu().tolist()
    unit_lens = mask.view(bs // granularity, granularity, -1).sum(dim=(1, 2)).long().cpu().tolist()

    units = allocate_balanced_mbs_synced(mb_spec, unit_lens, group)
    row_groups = [[u * granularity + j for u in unit for j in range(granularity)] for unit in units]
    forward_indices = [i for rows in row_groups for i in rows]
    backward_indices = [0] * bs
    for pos, i in enumerate(forward_indices):
        backward_indices[i] = pos

    split_keys = [
        k
        for k, v in data.items()
        if not is_multi_modal_key(k) and (k == "position_ids" or (torch.is_tensor(v) and v.numel() == bs * max_seqlen))
    ]
    shared = {k: v for k, v in data.items() if k not in split_keys and not is_multi_modal_key(k)}
    mbs = []
    for rows in row_groups:
        index = torch.tensor(rows, dtype=torch.long)
        mb = {k: data[k][index.to(data[k].device)] for k in split_keys}
        mb.update({k: [data[k][i] for i in rows] for k in data if is_multi_modal_key(k)})
        mbs.append({**mb, **shared})
    return MicroBatchList(
        data=data,
        mb_spec=mb_spec,
        mbs=mbs,
        forward_indices=forward_indices,
        backward_indices=backward_indices,
        group_lens=[sum(seq_lens[i] for i in rows) for rows in row_groups],
    )


# ------------------------------------------------------------------------------------------------ dataloaders


def cycle_dataloader(dataloader, num_cycles: int = -1) -> Iterator[Any]:
    """Batches epoch after epoch, `num_cycles` epochs or endlessly (-1, AReaL's default). Before each epoch it
    calls `dataloader.sampler.set_epoch(epoch)` when the sampler has it (a DistributedSampler then reshuffles);
    the kit's loaders reshuffle on their own and resume where a restored loader stands."""
    epoch = empty_epochs = 0
    while True:
        sampler = getattr(dataloader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        n = 0
        for batch in dataloader:
            n += 1
            yield batch
        epoch += 1
        if 0 < num_cycles <= epoch:
            return
        # One empty pass is normal: a state saved right after an epoch's last batch resumes at its end.
        empty_epochs = empty_epochs + 1 if n == 0 else 0
        if empty_epochs >= 2:
            raise ValueError("the dataloader produced no batches in an epoch (dataset smaller than batch_size?)")


# ------------------------------------------------------------------------------------------------ normalisation


class Normalization:
    """x^ = (x - mu) / (sigma + eps) with the statistics of a `NormConfig` (AReaL 1.0.4's rules and numbers).

    Pools: the whole batch (`batch`; summed over the ranks when torch.distributed is initialised) or contiguous
    blocks of `group_size` rows (`group`), over every unmasked element. mean level None -> mu = 0; leave-one-out
    mu_i = (sum - x_i) / (N - 1), 0 when N <= 1 (and for groups of one row). sigma: the spread around the mu
    actually subtracted, unbiased (N - 1) if `std_unbiased`; 1 when the pool is too small (N <= 1, or N = 0 when
    biased, or unbiased groups of one row); std level None -> sigma = 1 and no eps. Masked elements come out 0; a
    mask with nothing in it returns x unchanged. Sums are float64 unless `high_precision=False`; the result is
    float32.
    """

    def __init__(self, config: NormConfig):
        self.mean_level = config.mean_level
        self.mean_leave1out = config.mean_leave1out
        self.std_level = config.std_level
        self.std_unbiased = config.std_unbiased
        self.group_size = config.group_size
        self.eps = config.eps

    @torch.no_grad()
    def __call__(
        self,
        x: torch.Tensor,
        loss_mask: Optional[torch.Tensor] = None,
        high_precision: bool = True,
        reduce_group=None,
    ) -> torch.Tensor:
        if loss_mask is not None and loss_mask.sum().item() == 0:
            return x.float()
        return self.apply(x, loss_mask, high_precision=high_precision, reduce_group=reduce_group).float()

    @torch.no_grad()
    def apply(
        self,
        x: torch.Tensor,
        loss_mask: Optional[torch.Tensor] = None,
        *,
        high_precision: bool = True,
        all_reduce: bool = True,
        reduce_group=None,
    ) -> torch.Tensor:
        """The normalised x in the compute dtype (float64 with `high_precision`), not cast to float32 (kit extra).
        `all_reduce=False` keeps batch statistics local to this process (the kit's trainer gives every rank the
        whole batch, where summing over ranks would count each row once per rank)."""
        dtype = torch.float64 if high_precision else torch.float32
        xd = x.to(dtype)
        m = torch.ones_like(xd) if loss_mask is None else torch.broadcast_to(loss_mask.to(dtype), xd.shape)
        pool = _Pools(xd.shape[0], self.group_size, all_reduce, reduce_group)
        centre, scale = self.mean_level in ("batch", "group"), self.std_level in ("batch", "group")
        if "group" in (self.mean_level, self.std_level):
            pool.check_groups()
        mu = self._mean(xd, m, pool) if centre else torch.zeros_like(xd)
        centred = (xd - mu) * m
        if not scale:
            return centred
        return centred / (self._std(centred, m, pool) + self.eps)

    def _mean(self, x: torch.Tensor, m: torch.Tensor, pool: "_Pools") -> torch.Tensor:
        level, zero = self.mean_level, torch.zeros_like(x)
        if level == "group" and self.group_size == 1 and self.mean_leave1out:
            return zero  # one row per group: there is no "rest of the group"
        total, n = pool.sums(level, x * m, m)
        if not self.mean_leave1out:
            return torch.where(n > 0, total / n.clamp(min=1), zero)
        others = (total - x * m) / (n - m).clamp(min=1)
        return torch.where(n > 1, torch.where(m > 0, others, total / n.clamp(min=1)), zero)

    def _std(self, centred: torch.Tensor, m: torch.Tensor, pool: "_Pools") -> torch.Tensor:
        level, one = self.std_level, torch.ones_like(centred)
        if level == "group" and self.group_size == 1 and self.std_unbiased:
            return one  # one row per group has no spread; divide by 1, not by eps
        sq, n = pool.sums(level, centred**2, m)
        if self.std_unbiased:
            return torch.where(n > 1, (sq / (n - 1).clamp(min=1)).sqrt(), one)
        return torch.where(n > 0, (sq / n.clamp(min=1)).sqrt(), one)


class _Pools:
    """Sums over the pool of every element (the batch, or each element's group of rows), broadcast back."""

    def __init__(self, batch_size: int, group_size: int, all_reduce: bool, reduce_group):
        self.batch_size, self.group_size = batch_size, group_size
        self.all_reduce, self.reduce_group = all_reduce, reduce_group

    def check_groups(self) -> None:
        B, G = self.batch_size, self.group_size
        if G < 1 or B % G:
            raise ValueError(
                f"group normalisation needs the batch size ({B}) to be a multiple of group_size ({G}); "
                "a grouped workflow returns exactly group_size contiguous rows per prompt"
            )

    def sums(self, level: str, values: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of values, sum of counts) over each element's pool, shaped like `values`."""
        B, shape = self.batch_size, values.shape
        rows = torch.stack([values.reshape(B, -1).sum(1), counts.reshape(B, -1).sum(1)])  # [2, B]
        if level == "batch":
            pooled = rows.sum(1, keepdim=True)
            if self.all_reduce and dist.is_initialized():
                dist.all_reduce(pooled, op=dist.ReduceOp.SUM, group=self.reduce_group)
            pooled = pooled.expand(2, B)
        else:
            G = self.group_size
            pooled = rows.view(2, B // G, G).sum(2).repeat_interleave(G, dim=1)
        view = (B,) + (1,) * (len(shape) - 1)
        return pooled[0].view(view).expand(shape), pooled[1].view(view).expand(shape)
