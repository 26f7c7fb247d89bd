"""The rows the scheduler generates, and the running batch that decodes them over one shared KV cache.

Design decisions
- Left-padded batch KV cache. All rows share one `transformers.DynamicCache` whose per-layer tensors are
  `[B, heads, T, head_dim]`. Rows of different lengths are *left*-padded so every row's newest token sits in the
  last column; an attention mask marks padding, and explicit `position_ids` give each row its own positions, so
  padding changes nothing numerically (greedy output is the same alone or batched).
- Joining = pad the running cache and the newcomers' cache to a common length and concatenate along the batch
  dimension; it happens only when newcomers arrive, so a steady batch pays nothing for it. Leaving =
  `index_select` the surviving rows, then drop leading columns that are padding in every row, so the cache does
  not keep the width of a long prompt that has already finished.
- `GenerationState` is plain data the scheduler thread owns; the HTTP side reads it only after `on_done` fired.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from areal_lite.serve.protocol import DEFAULT_WEIGHT_VERSION, SamplingParams


@dataclass(eq=False)
class GenerationState:
    """One row of generation: a prompt plus the tokens sampled for it so far (one sample of one prompt)."""

    rid: str
    parent: str  # the rid the client sent (differs from rid only for n > 1 samples)
    prompt: list[int]
    params: SamplingParams
    return_logprob: bool
    stop_ids: frozenset[int]  # EOS + stop_token_ids; empty when ignore_eos
    arrival: float = field(default_factory=time.perf_counter)
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: Optional[dict] = None
    weight_version: str = DEFAULT_WEIGHT_VERSION
    finished_at: float = 0.0
    on_done: Optional[Callable[["GenerationState"], None]] = None


def left_pad(t: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """Pad `t` with zeros at the front of `dim` up to `length`."""
    missing = length - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


class RunningBatch:
    """B rows decoding together over one left-padded KV cache.

    Invariants: every per-layer key/value tensor is [B, heads, T, head_dim]; `mask` is [B, T] (False = padding);
    `next_ids[b]` is row b's newest token, sampled but not yet fed to the model; `pos[b]` is its position
    (= number of real tokens before it).
    """

    def __init__(self) -> None:
        self.seqs: list[GenerationState] = []
        self.cache: Any = None
        self.mask: Optional[torch.Tensor] = None
        self.next_ids: Optional[torch.Tensor] = None
        self.pos: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return len(self.seqs)

    def add(
        self, seqs: list[GenerationState], cache: Any, mask: torch.Tensor, next_ids: torch.Tensor, pos: torch.Tensor
    ) -> None:
        """Join newcomers (with their own prefilled cache) into the batch: pad both to a common length, concat."""
        if not self.seqs:
            self.seqs, self.cache, self.mask, self.next_ids, self.pos = list(seqs), cache, mask, next_ids, pos
            return
        length = max(self.mask.shape[1], mask.shape[1])
        for mine, theirs in zip(self.cache.layers, cache.layers):
            mine.keys = torch.cat([left_pad(mine.keys, length, 2), left_pad(theirs.keys, length, 2)], dim=0)
            mine.values = torch.cat([left_pad(mine.values, length, 2), left_pad(theirs.values, length, 2)], dim=0)
        self.mask = torch.cat([left_pad(self.mask, length, 1), left_pad(mask, length, 1)], dim=0)
        self.next_ids = torch.cat([self.next_ids, next_ids])
        self.pos = torch.cat([self.pos, pos])
        self.seqs.extend(seqs)

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (finished or aborted rows leave), then drop columns that are padding in every row."""
        if len(rows) == len(self.seqs):
            return
        if not rows:
            self.__init__()
            return
        idx = torch.tensor(rows, device=self.mask.device)
        self.seqs = [self.seqs[i] for i in rows]
        self.mask = self.mask.index_select(0, idx)
        self.next_ids = self.next_ids.index_select(0, idx)
        self.pos = self.pos.index_select(0, idx)
        # The longest row may have left: the first columns can now be padding for everyone.
        first = int(self.mask.any(dim=0).int().argmax())
        self.mask = self.mask[:, first:]
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, idx)[:, :, first:]
            layer.values = layer.values.index_select(0, idx)[:, :, first:]


def select_cache_rows(cache: Any, rows: torch.Tensor) -> None:
    """Keep (or repeat) the batch rows `rows` of every layer of `cache`, in place."""
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(0, rows)
        layer.values = layer.values.index_select(0, rows)


def prefill_forward(
    model: Any, prompts: list[list[int]], device: torch.device
) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """Run `prompts` through `model` left-padded. Returns (cache, mask [B, T], last-position logits [B, V]), one
    row per prompt. Identical prompts (the n > 1 samples of one prompt) are computed once and their rows copied."""
    from transformers import DynamicCache

    unique: dict[tuple, int] = {}
    row_of = [unique.setdefault(tuple(p), len(unique)) for p in prompts]
    distinct = [list(p) for p in unique]
    length = max(len(p) for p in distinct)
    ids = torch.zeros(len(distinct), length, dtype=torch.long)
    mask = torch.zeros(len(distinct), length, dtype=torch.bool)
    for i, p in enumerate(distinct):  # left padding: every prompt ends in the last column
        ids[i, length - len(p) :] = torch.tensor(p)
        mask[i, length - len(p) :] = True
    ids, mask = ids.to(device), mask.to(device)
    pos = (mask.long().cumsum(1) - 1).clamp(min=0)
    cache = DynamicCache()
    out = model(
        input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1
    )
    logits = out.logits[:, -1]
    if row_of != list(range(len(prompts))):
        expand = torch.tensor(row_of, device=device)
        select_cache_rows(cache, expand)
        mask = mask.index_select(0, expand)
        logits = logits.index_select(0, expand)
    return cache, mask, logits


def decode_forward(model: Any, batch: RunningBatch) -> torch.Tensor:
    """Feed every row's newest token (`next_ids`) to the model; returns the next logits [B, V]. Advances the mask
    and positions; the caller samples the new `next_ids`."""
    mask = torch.cat([batch.mask, batch.mask.new_ones(len(batch), 1)], dim=1)
    out = model(
        input_ids=batch.next_ids[:, None], attention_mask=mask, position_ids=batch.pos[:, None],
        past_key_values=batch.cache, use_cache=True,
    )  # fmt: skip
    batch.mask, batch.pos = mask, batch.pos + 1
    return out.logits[:, -1]


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
