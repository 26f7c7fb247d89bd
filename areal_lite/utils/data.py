"""Batch helpers at AReaL 1.0.4's `areal.utils.data` path: `concat_padded_tensors` (rows of different lengths into
one right-padded batch) and `cycle_dataloader` (epoch after epoch, reshuffled; `itertools.cycle` would replay the
first epoch's cached batches).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Dict, Optional, Sequence

import torch

__all__ = ["cycle_dataloader", "concat_padded_tensors"]


def concat_padded_tensors(
    tensor_dicts: Sequence[Dict[str, torch.Tensor]],
    pad_value: float = 0.0,
    *,
    pad_token_id: Optional[int] = None,
) -> Dict[str, torch.Tensor]:
    """Right-pad every `[b, L, ...]` tensor to the longest L and concatenate all dicts on dim 0 (AReaL's function).

    1-D tensors (`rewards` `[b]`) are concatenated as they are. Padding, as AReaL's: attention_mask False, every
    other key `pad_value`; kit extra: `pad_token_id` for input_ids. An empty list gives `{}`; a None item (a
    rejected episode) or dicts with different keys raise with a message saying which.
    """
    results = tensor_dicts
    results = list(results)
    if not results:
        return {}
    for i, r in enumerate(results):
        if not isinstance(r, dict):
            raise TypeError(
                f"concat_padded_tensors: item {i} is {type(r).__name__}, expected dict[str, Tensor] "
                "(filter out rejected episodes, which return None, first)"
            )
    keys = list(results[0].keys())
    for i, r in enumerate(results[1:], start=1):
        if set(r.keys()) != set(keys):
            missing, extra = sorted(set(keys) - set(r)), sorted(set(r) - set(keys))
            raise ValueError(
                f"concat_padded_tensors: item {i} has different keys than item 0 (missing {missing}, extra {extra})"
            )
    for i, r in enumerate(results):
        sizes = {k: (v.shape[0] if isinstance(v, torch.Tensor) and v.dim() > 0 else None) for k, v in r.items()}
        bad = [k for k, s in sizes.items() if s is None]
        if bad:
            raise ValueError(f"concat_padded_tensors: item {i} keys {bad} are not tensors with a batch dimension")
        if len(set(sizes.values())) > 1:
            raise ValueError(f"concat_padded_tensors: item {i} has keys with different batch sizes: {sizes}")

    out: Dict[str, torch.Tensor] = {}
    for key in keys:
        tensors = [r[key] for r in results]
        dims = {t.dim() for t in tensors}
        if len(dims) != 1:
            raise ValueError(f"concat_padded_tensors: key {key!r} has different numbers of dimensions {sorted(dims)}")
        if dims == {1}:
            out[key] = torch.cat(tensors, dim=0)
            continue
        max_len = max(t.shape[1] for t in tensors)
        if key == "input_ids" and pad_token_id is not None:
            fill = pad_token_id
        else:
            fill = False if key == "attention_mask" else pad_value
        padded = []
        for t in tensors:
            if t.shape[1] < max_len:
                pad_shape = (t.shape[0], max_len - t.shape[1]) + tuple(t.shape[2:])
                t = torch.cat([t, torch.full(pad_shape, fill, dtype=t.dtype, device=t.device)], dim=1)
            padded.append(t)
        out[key] = torch.cat(padded, dim=0)
    return out


def cycle_dataloader(dataloader, num_cycles: int = -1) -> Iterator[list[dict]]:
    """Batches epoch after epoch (reshuffled), `num_cycles` epochs or endlessly (-1, AReaL's default); resumes
    where the loader stands."""
    empty_epochs = epochs = 0
    while True:
        n = 0
        for batch in dataloader:
            n += 1
            yield batch
        epochs += 1
        if 0 < num_cycles <= epochs:
            return
        # One empty pass is normal: a state saved right after an epoch's last batch resumes at its end.
        empty_epochs = empty_epochs + 1 if n == 0 else 0
        if empty_epochs >= 2:
            raise ValueError("the dataloader produced no batches in an epoch (dataset smaller than batch_size?)")
