"""The rows the scheduler generates, the running batch that decodes them over one shared KV cache, and the runner
that computes them through the model's own forward.

Design decisions
- A runner owns the model arithmetic: `prefill(prompts)` -> (their keys/values, last logits), `decode(batch)` ->
  next logits, `new_kv()` -> an empty cache for the running batch. `fastpath.make_runner` picks
  `fastpath.FastRunner` (a functional forward over a preallocated cache) for the architectures it reproduces and
  `HFRunner` (below, the model's own forward) for every other model; the scheduler cannot tell them apart.
  Identical prompts (the n > 1 samples of one prompt) are computed once by `prefill_distinct`, above the runners,
  not by each of them.
- Left-padded batch KV cache, in both runners. Rows of different lengths are *left*-padded so every row's newest
  token sits in the same (last) column; an attention mask marks padding, and explicit positions give each row its
  own, so padding changes nothing numerically (greedy output is the same alone or batched).
- `HFKV`, the HF runner's cache, is a `transformers.DynamicCache` with per-layer tensors `[B, heads, T, head_dim]`.
  Joining = pad the running cache and the newcomers' cache to a common length and concatenate along the batch
  dimension; it happens only when newcomers arrive. Leaving = `index_select` the surviving rows, then drop leading
  columns that are padding in every row, so the cache does not keep the width of a long prompt that has finished.
  (Each decode step still concatenates one column to every layer inside `DynamicCache`; the fast path does not.)
- The cache goes in under the name the model's `forward` declares: `cache` from transformers 5.24 on, where
  `past_key_values` is deprecated (removed in 5.40), and `past_key_values` in the earlier 5.x releases we support.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch

from areal_lite.kit.server.protocol import GenerationState


def left_pad(t: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """Pad `t` with zeros at the front of `dim` up to `length`."""
    missing = length - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def fill_places(rows: list[int]) -> list[int]:
    """The order of the rows that stay (`rows`, ascending), each free place below len(rows) taken by a row from
    beyond it: row j of the result is old row result[j]. Rows already below len(rows) keep their place, so a cache
    moves one row per row that left instead of every row after it (a row's numbers do not depend on its place)."""
    m = len(rows)
    stay = set(rows)
    free = [j for j in range(m) if j not in stay]
    order = list(range(m))
    for place, row in zip(free, [r for r in rows if r >= m]):
        order[place] = row
    return order


class RunningBatch:
    """B rows decoding together over one KV cache `kv` (the runner's: `HFKV` or `fastpath.StaticKV`).

    Invariants: `kv` holds B left-padded rows, in the order of `seqs`; `next_ids[b]` is row b's newest token,
    sampled but not yet fed to the model; `pos[b]` is its position (= number of real tokens before it).
    """

    def __init__(self, kv: Any = None) -> None:
        self.seqs: list[GenerationState] = []
        self.kv: Any = kv if kv is not None else HFKV()
        self.next_ids: Optional[torch.Tensor] = None
        self.pos: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return len(self.seqs)

    def add(self, seqs: list[GenerationState], part: Any, next_ids: torch.Tensor, pos: torch.Tensor) -> None:
        """Join newcomers, with their prefilled keys/values `part` (one row each), into the batch."""
        self.kv.join(part)
        if self.seqs:
            next_ids, pos = torch.cat([self.next_ids, next_ids]), torch.cat([self.pos, pos])
        self.next_ids, self.pos = next_ids, pos
        self.seqs.extend(seqs)

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (finished or aborted rows leave); the cache drops columns that are padding in every row.
        The last rows take the places of those that left (`fill_places`), so only they move in the cache."""
        if len(rows) == len(self.seqs):
            return
        rows = fill_places(rows)
        self.kv.keep(rows)
        if not rows:
            self.seqs, self.next_ids, self.pos = [], None, None
            return
        idx = torch.tensor(rows, device=self.next_ids.device)
        self.seqs = [self.seqs[i] for i in rows]
        self.next_ids = self.next_ids.index_select(0, idx)
        self.pos = self.pos.index_select(0, idx)


class HFKV:
    """The cache of the model's own forward: a `DynamicCache` whose per-layer tensors are [B, heads, T, head_dim],
    left-padded, and the mask [B, T] (False = padding). A prefill's output and the running batch's cache alike."""

    def __init__(self, cache: Any = None, mask: Optional[torch.Tensor] = None) -> None:
        self.cache, self.mask = cache, mask

    def select(self, rows: torch.Tensor) -> None:
        """Keep (or repeat) rows `rows`."""
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, rows)
            layer.values = layer.values.index_select(0, rows)
        self.mask = self.mask.index_select(0, rows)

    def join(self, part: "HFKV") -> None:
        """Pad both caches to a common length and concatenate `part`'s rows after ours."""
        if self.cache is None:
            self.cache, self.mask = part.cache, part.mask
            return
        length = max(self.mask.shape[1], part.mask.shape[1])
        for mine, theirs in zip(self.cache.layers, part.cache.layers):
            mine.keys = torch.cat([left_pad(mine.keys, length, 2), left_pad(theirs.keys, length, 2)], dim=0)
            mine.values = torch.cat([left_pad(mine.values, length, 2), left_pad(theirs.values, length, 2)], dim=0)
        self.mask = torch.cat([left_pad(self.mask, length, 1), left_pad(part.mask, length, 1)], dim=0)

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows`, in that order, then drop leading columns that are padding in every row (the longest row
        may have left)."""
        if not rows:
            self.cache = self.mask = None
            return
        self.select(torch.tensor(rows, device=self.mask.device))
        first = int(self.mask.any(dim=0).int().argmax())
        self.mask = self.mask[:, first:]
        for layer in self.cache.layers:
            layer.keys = layer.keys[:, :, first:]
            layer.values = layer.values[:, :, first:]


def cache_keyword(model: Any) -> str:
    """The keyword `model.forward` takes its KV cache under: "cache" (transformers >= 5.24) or "past_key_values"."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class HFRunner:
    """Prefill and decode through the model's own forward (any causal LM `transformers` can run)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.cache_kw = cache_keyword(model)

    def new_kv(self, max_rows: int = 0) -> HFKV:
        return HFKV()

    def refresh(self) -> None:
        """Call after the model's weights changed in place (nothing is derived from them here)."""

    def prefill(self, prompts: list[list[int]]) -> tuple[HFKV, torch.Tensor]:
        """Run `prompts` left-padded. Returns (their cache, last-position logits [B, V]), one row per prompt."""
        from transformers import DynamicCache

        length = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), length, dtype=torch.long)
        mask = torch.zeros(len(prompts), length, dtype=torch.bool)
        for i, p in enumerate(prompts):  # left padding: every prompt ends in the last column
            ids[i, length - len(p) :] = torch.tensor(p)
            mask[i, length - len(p) :] = True
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.long().cumsum(1) - 1).clamp(min=0)
        cache = DynamicCache()
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
            **{self.cache_kw: cache},
        )  # fmt: skip
        return HFKV(cache, mask), out.logits[:, -1]

    def decode(self, batch: RunningBatch) -> torch.Tensor:
        """Feed every row's newest token (`next_ids`) to the model; returns the next logits [B, V]. Advances the mask
        and positions; the caller samples the new `next_ids`."""
        kv: HFKV = batch.kv
        mask = torch.cat([kv.mask, kv.mask.new_ones(len(batch), 1)], dim=1)
        out = self.model(
            input_ids=batch.next_ids[:, None], attention_mask=mask, position_ids=batch.pos[:, None], use_cache=True,
            **{self.cache_kw: kv.cache},
        )  # fmt: skip
        kv.mask, batch.pos = mask, batch.pos + 1
        return out.logits[:, -1]


def prefill_distinct(runner: Any, prompts: list[list[int]]) -> tuple[Any, torch.Tensor]:
    """`runner.prefill` with each distinct prompt computed once (the n > 1 samples of one prompt share it), its
    keys/values and logits then repeated: one row per prompt, in order. Runners prefill every row they are given."""
    unique: dict[tuple, int] = {}
    row_of = [unique.setdefault(tuple(p), len(unique)) for p in prompts]
    part, logits = runner.prefill([list(p) for p in unique])
    if row_of != list(range(len(prompts))):
        expand = torch.tensor(row_of, device=logits.device)
        part.select(expand)
        logits = logits.index_select(0, expand)
    return part, logits


def prefill_groups(states: list[GenerationState], max_tokens: int) -> list[list[GenerationState]]:
    """Split newcomers, in order, into prefill batches of at most `max_tokens` padded tokens (rows x longest prompt);
    a prompt longer than the budget gets a batch of its own. Bounds the memory of one prefill's activations."""
    groups: list[list[GenerationState]] = []
    for s in states:
        if groups:
            longest = max([len(s.prompt)] + [len(g.prompt) for g in groups[-1]])
            if longest * (len(groups[-1]) + 1) <= max_tokens:
                groups[-1].append(s)
                continue
        groups.append([s])
    return groups
