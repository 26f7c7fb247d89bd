"""The fast path: Llama/Qwen2-family models run by a short functional forward over a preallocated KV cache.

Design decisions
- Why: for a small model on CPU the `transformers` forward adds mask building, cache bookkeeping and module dispatch
  around each step's few hundred small kernels, and its `DynamicCache` copies every layer's keys and values each
  step. Here the cache is written in place, one column per step (`StaticKV`), and a layer is a dozen tensor calls.
- The same numbers as the model's own forward: the same operations in the same order (RMSNorm in float32, the
  model's own `rotary_emb` tables), so logprobs stay the trainer's up to matmul rounding.
- Weights (`_Linear`): q/k/v and gate/up are one matmul each over a fused matrix whose views are the model's
  parameters, so a weight update's `copy_` reaches it. On CPU the weight matmuls run through oneDNN-reordered copies
  where those keep rows exact (faster than MKL on decode batches, the weights held twice, re-packed by `refresh`).
- Batch-invariant on CPU: a row's logits are bit for bit the same whatever rows share its batch, so a seeded request
  samples the same tokens alone, beside others or joining a running batch (with `sampling.py`'s per-request
  streams). It takes weight matmuls that keep rows exact (oneDNN's; `weight_matmuls` checks at start-up),
  prefill attention over each prompt's keys padded to whole `KV_ALIGN` columns, prompts batched (one product per
  token where this CPU's batched matmul changes with the row count, also measured at start-up), decode over a
  newest-first cache window, and sums over values in fixed 128-column chunks (`value_sum`), for contexts of any
  length. Tested by `tests/test_serve.py`; `HFRunner` and GPUs make no such promise.
- Only what this forward reproduces takes this path (`supports`); any other model runs its own (`batch.HFRunner`).
- Prefill runs the start all prompts share once (`prefill`), exactly. bench/rollout_throughput.py measures it.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

from areal_lite.kit.server.batch import HFRunner
from areal_lite.utils.device import own_file_backed
from areal_lite.utils.prefix import common_start

log = logging.getLogger("areal_lite.kit.server")  # the server's one logger


def supports(model: Any) -> bool:
    """Whether `FastRunner` reproduces `model`'s forward."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in ("llama", "qwen2"):
        return False
    if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "mlp_bias", False):
        return False
    if getattr(cfg, "use_sliding_window", False) or getattr(cfg, "pretraining_tp", 1) != 1:
        return False
    inner = getattr(model, "model", None)
    return inner is not None and hasattr(inner, "rotary_emb") and hasattr(inner, "layers")


class PrefillKV:
    """A prefill's keys/values: per layer [P, kv_heads, L, head_dim] for its P prompts, newest token first (as
    `StaticKV` keeps them; padding after each prompt), and the mask [B, L] of its B rows. Row b holds prompt
    `rows[b]`: `select` (the n samples of one prompt, the rows that survive their first token) only records which,
    and `StaticKV.join` copies each prompt's keys straight to the rows that hold it (repeating a prompt's keys
    first, then copying them again into the cache, is a second full copy per prefill)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], mask: torch.Tensor):
        self.keys, self.values, self.mask = keys, values, mask
        self.rows: Optional[torch.Tensor] = None  # None: row b holds prompt b

    def select(self, rows: torch.Tensor) -> None:
        """Keep (or repeat) rows `rows`."""
        self.rows = rows if self.rows is None else self.rows.index_select(0, rows)
        self.mask = self.mask.index_select(0, rows)

    def runs(self) -> list[tuple[int, int, int]]:
        """(first row, end row, prompt) for each run of consecutive rows that hold the same prompt (after `select`)."""
        out: list[tuple[int, int, int]] = []
        for b, p in enumerate(self.rows.tolist()):
            if out and out[-1][2] == p and out[-1][1] == b:
                out[-1] = (out[-1][0], b + 1, p)
            else:
                out.append((b, b + 1, p))
        return out


KV_ALIGN = 32  # decode attends over a whole number of these columns (see StaticKV)
VALUE_CHUNK = 128  # key columns per product of attention weights x values (`value_sum`)


def value_sum(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """probs [..., m, width] @ values [..., width, d], the key columns summed VALUE_CHUNK at a time, in order.

    Why: a row's width is its batch's (the longest row's keys, padded), and MKL's batched matmul groups a sum over
    more than 192 columns otherwise than a narrower one, so a 150-key row would get other bits padded to 224
    columns than to 160. A chunk of at most VALUE_CHUNK columns is summed whole, where the zero columns past a row's
    keys add exact zeros (`padded_sums_exact` checks that at start-up), and the chunks add in one order whatever the
    width. A width of VALUE_CHUNK or less is the one plain product."""
    product = torch.bmm if probs.dim() == 3 else torch.matmul  # bmm: an expanded (zero-stride) operand is not copied
    if probs.shape[-1] <= VALUE_CHUNK:
        return product(probs, values)
    out = product(probs[..., :VALUE_CHUNK], values[..., :VALUE_CHUNK, :])
    for c in range(VALUE_CHUNK, probs.shape[-1], VALUE_CHUNK):
        out.add_(product(probs[..., c : c + VALUE_CHUNK], values[..., c : c + VALUE_CHUNK, :]))
    return out


class StaticKV:
    """The running rows' keys/values in preallocated buffers, newest token first. Live: rows [0, n), columns
    [start, end); every row's newest cached token is in column `start`, its older ones follow, and `mask` marks the
    real tokens of the window (each row's are columns start .. start + its length - 1).

    Why newest first: a row's keys then begin at the window's first column whatever the other rows hold, so the
    reductions of decode attention (scores, softmax, the sum over values) see its tokens at the same offsets in every
    batch. With the window rounded up to `aligned_width()` columns (padding after it is masked, and the buffers keep
    room for it), the matmul kernels also see the same shapes for its blocks, so a row's attention is bit-for-bit
    the same alone or beside any others (MKL's is not at widths that are not multiples of 8).

    Buffers are [rows, kv_heads, cols, head_dim] per layer. Decode writes one column in place, left of the window;
    rows join by writing their prefill into free rows, and the last rows move into the places of rows that leave.
    Buffers are reallocated (live window copied) only when rows or columns run out, growing by half, and dropped
    when the batch empties. malloc keeps their memory for the next batch (the server's CLI sets
    `utils.device.keep_freed_memory`): handed back to the OS, it would be page-faulted in again at every rollout,
    dearly on a VM that returns freed pages to its host (bench/eval_cost.py times a rollout)."""

    def __init__(
        self, n_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, max_rows: int = 0
    ):
        self.n_layers, self.kv_heads, self.head_dim = n_layers, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.max_rows = max_rows  # rows grow by half, but past this only as far as needed (0: no such bound)
        self.clear()

    def clear(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.mask = torch.zeros(0, 0, dtype=torch.bool, device=self.device)
        self.n = self.start = self.end = 0

    @property
    def width(self) -> int:
        return self.end - self.start

    def window_mask(self) -> torch.Tensor:
        return self.mask[: self.n, self.start : self.end]

    def aligned_width(self) -> int:
        """The window's width rounded up to a multiple of KV_ALIGN (the buffers always have these columns)."""
        return -(-self.width // KV_ALIGN) * KV_ALIGN

    def _relayout(self, rows: int, cols: int, start: int) -> None:
        """New zeroed buffers of `rows` x `cols`, the live window copied to begin at column `start`. Each old layer is
        dropped once copied, so the old and the new cache are never held whole at once (the peak is the larger one
        plus a layer, not their sum: what malloc keeps afterwards)."""
        n, s, e, w = self.n, self.start, self.end, self.width
        shape = (rows, self.kv_heads, cols, self.head_dim)
        old = list(zip(self.keys, self.values))[::-1]  # popped from the end: layer 0 first
        self.keys, self.values = [], []
        keys, values = [], []
        for _ in range(self.n_layers):
            k = torch.zeros(shape, dtype=self.dtype, device=self.device)
            v = torch.zeros(shape, dtype=self.dtype, device=self.device)
            if old:
                old_k, old_v = old.pop()
                if n and w:
                    k[:n, :, start : start + w] = old_k[:n, :, s:e]
                    v[:n, :, start : start + w] = old_v[:n, :, s:e]
                del old_k, old_v
            keys.append(k)
            values.append(v)
        mask = torch.zeros(rows, cols, dtype=torch.bool, device=self.device)
        if n and w:
            mask[:n, start : start + w] = self.mask[:n, s:e]
        self.keys, self.values, self.mask = keys, values, mask
        self.start, self.end = start, start + w

    def _regrow(self, rows: int, width: int) -> None:
        """`_relayout` for a window up to `width` wide: free columns on the left (decode writes there) and KV_ALIGN
        on the right (the aligned window reads there)."""
        room = max(32, width // 2)
        self._relayout(rows, room + width + KV_ALIGN, room)

    def join(self, part: PrefillKV) -> None:
        """Add `part`'s rows after the live ones, their newest token in column `start` like theirs."""
        m, length = part.mask.shape
        rows_cap, cols_cap = self.mask.shape
        if self.n + m > rows_cap or self.start + length + KV_ALIGN > cols_cap:
            rows = rows_cap + rows_cap // 2
            rows = max(self.n + m, min(rows, self.max_rows) if self.max_rows else rows)
            self._regrow(rows, max(self.width, length))
        n, s, e = self.n, self.start, self.start + length
        if e > self.end:  # the window widens to the right: those columns are padding for the live rows
            self.mask[:n, self.end : e] = False
            self.end = e
        runs = None if part.rows is None else part.runs()
        broadcast = runs is not None and len(runs) * 2 <= m  # few prompts, each in several rows: a copy per prompt
        for i in range(self.n_layers):
            for dst, src in ((self.keys[i], part.keys[i]), (self.values[i], part.values[i])):
                if broadcast:
                    for a, b, p in runs:
                        dst[n + a : n + b, :, s:e] = src[p]
                else:
                    dst[n : n + m, :, s:e] = src if part.rows is None else src.index_select(0, part.rows)
        self.mask[n : n + m, s:e] = part.mask
        self.mask[n : n + m, e : self.end] = False
        self.n += m

    def append_column(self) -> int:
        """Open column `start - 1` for every live row (decode writes its new key/value there); returns its index."""
        if self.start == 0:
            self._regrow(self.mask.shape[0], self.width)
        self.start -= 1
        self.mask[: self.n, self.start] = True
        return self.start

    def keep(self, rows: list[int]) -> None:
        """Keep only live rows `rows`, in that order (row j becomes old row rows[j]), then drop columns that are
        padding in every row. Only the rows whose place changes are copied."""
        if not rows:
            self.clear()  # the memory stays with malloc for the next batch (class docstring)
            return
        m, s, e = len(rows), self.start, self.end
        moved = [j for j, r in enumerate(rows) if r != j]
        if moved:
            to = torch.tensor(moved, device=self.device)
            src = torch.tensor([rows[j] for j in moved], device=self.device)
            for buf in self.keys + self.values + [self.mask]:
                window = buf[:, s:e] if buf is self.mask else buf[:, :, s:e]
                window.index_copy_(0, to, window.index_select(0, src))
        self.n = m
        self.end -= int(self.window_mask().any(dim=0).flip(0).int().argmax())


def _return_freed_memory() -> None:
    """Hand freed heap memory back to the OS (glibc keeps large freed blocks otherwise); a no-op elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _rms_norm(x: torch.Tensor, norm: Any) -> torch.Tensor:
    """`LlamaRMSNorm`/`Qwen2RMSNorm`, operation for operation."""
    dtype = x.dtype
    if dtype == torch.float32 and norm.weight.dtype == dtype:  # torch's one call: the same bits, fewer dispatches
        return F.rms_norm(x, x.shape[-1:], norm.weight, norm.variance_epsilon)
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * variance.add_(norm.variance_epsilon).rsqrt_()  # in place on our own temporaries: the same numbers
    if norm.weight.dtype != dtype:  # a norm kept in another dtype: the result takes the promoted one, as the model's
        return norm.weight * h.to(dtype)
    return h.to(dtype).mul_(norm.weight)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rotary_pos_emb` for x [N, heads, D] and cos/sin [N, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos).add_(rotated.mul_(sin))


MIN_SHARED_START = 8  # a shorter common start is not worth a segment of its own
QUERY_CHUNK = 256  # prefill attention's query rows per matmul: bounds its scores to 256 x the prompt's length
BATCHED_SCORES = 1 << 23  # floats of scores (32 MB in float32) up to which prompts' attention runs batched


def shared_start(prompts: list[list[int]]) -> int:
    """How many leading tokens all `prompts` (two or more) have in common, leaving each at least one of its own (its
    last position gives its logits); 0 below MIN_SHARED_START. The trainer's rule (`utils.prefix.common_start`),
    whose bound counts the tokens saved: MIN_SHARED_START for every prompt after the first is a start of at least
    MIN_SHARED_START."""
    return common_start(prompts, min_saved=MIN_SHARED_START * (len(prompts) - 1))


def _sequences(shared: int, own_at: list[int], lens: list[int]) -> torch.Tensor:
    """The packed rows of each prompt's whole sequence, prompt after prompt: the shared start's, then its own."""
    return torch.cat([torch.cat([torch.arange(shared), torch.arange(o, o + n - shared)]) for o, n in zip(own_at, lens)])


def _causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, scaling: float, out: torch.Tensor,
    per_token: bool = False,
) -> None:  # fmt: skip
    """Causal attention of queries q [m, heads, D] at positions first .. first + m - 1 over one prompt's keys and
    values k, v [n, kv_heads, D] (positions 0 .. n - 1), into out [m, heads * D].

    A query's numbers depend only on its own and earlier tokens, not on how many queries or keys the call holds:
    the keys are padded to a whole number of KV_ALIGN columns (masked), so each row's scores, softmax and sum over
    values come out of the same kernel blocks, as in decode. A prompt therefore gets the same bits prefilled whole
    or after its start was computed apart (the shared start), in chunks of any size (tests/test_serve.py). sdpa's
    flash kernel does not promise that: its blocks follow the call's length. Where the batched matmul itself picks
    its kernel by the number of rows (`rows_independent_bmm` is False), `per_token` gives every token its own
    product of `rep` query rows, as decode does.
    """
    m, heads, d = q.shape
    n, kv_heads = k.shape[0], k.shape[1]
    rep, width = heads // kv_heads, -(-n // KV_ALIGN) * KV_ALIGN
    keys, values = k.new_zeros(kv_heads, width, d), v.new_zeros(kv_heads, width, d)
    keys[:, :n], values[:, :n] = k.transpose(0, 1), v.transpose(0, 1)
    cols = torch.arange(width, device=q.device)
    for c in range(0, m, QUERY_CHUNK):
        mc = min(QUERY_CHUNK, m - c)
        pos = torch.arange(first + c, first + c + mc, device=q.device)
        bias = torch.zeros(mc, width, dtype=q.dtype, device=q.device).masked_fill_(cols > pos[:, None], float("-inf"))
        if per_token:
            _attend_per_token(q[c : c + mc], keys, values, bias, scaling, out[c : c + mc])
            continue
        chunk, mq = q[c : c + mc], max(mc, 2)
        if mc == 1:  # a lone token's `rep` rows take another kernel (`rows_independent_bmm`): give it company
            chunk, bias = chunk.expand(2, -1, -1), bias.expand(2, -1)
        qs = chunk.reshape(mq, kv_heads, rep, d).permute(1, 2, 0, 3).reshape(kv_heads, rep * mq, d)
        scores = torch.bmm(qs, keys.transpose(1, 2)).view(kv_heads, rep, mq, width)
        probs = torch.softmax(scores.mul_(scaling).add_(bias), dim=-1)
        o = value_sum(probs.view(kv_heads, rep * mq, width), values).view(kv_heads, rep, mq, d)
        out[c : c + mc].view(mc, kv_heads, rep, d).copy_(o.permute(2, 0, 1, 3)[:mc])


def _attend_per_token(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scaling: float, out: torch.Tensor
) -> None:
    """`_causal_attention`'s chunk with one product per (token, key head): its `rep` query rows over the head's keys,
    decode's shape, whatever the chunk holds. The keys are broadcast, not copied (a zero batch stride)."""
    mc, heads, d = q.shape
    kv_heads, width = keys.shape[0], keys.shape[1]
    qh, oh = q.view(mc, kv_heads, heads // kv_heads, d), out.view(mc, kv_heads, heads // kv_heads, d)
    for h in range(kv_heads):
        scores = torch.bmm(qh[:, h], keys[h].t().expand(mc, d, width))  # [mc, rep, width]
        probs = torch.softmax(scores.mul_(scaling).add_(bias[:, None, :]), dim=-1)
        oh[:, h].copy_(value_sum(probs, values[h].expand(mc, width, d)))  # [mc, rep, d]


def _pad(t: torch.Tensor, slot: torch.Tensor, B: int, L: int) -> torch.Tensor:
    """Packed [N, heads, D] -> [B, heads, L, D] at `slot` (zeros in padding)."""
    out = t.new_zeros(B * L, t.shape[1], t.shape[2]).index_copy_(0, slot, t)
    return out.view(B, L, t.shape[1], t.shape[2]).transpose(1, 2).contiguous()


class _PromptsAttention:
    """Every prompt's own tokens (positions `first` on) over its whole sequence, in one pair of products for as many
    prompts as `BATCHED_SCORES` allows (a prompt's call is a dozen small tensor calls: for 32 short prompts that
    costs more than their products). Prompt i's queries are rows own_at[i] .. of the packed q, its keys and values
    rows seq_at[i] .. of the packed sequences. Prompts whose keys pad to the same whole KV_ALIGN columns run
    together, their queries padded to the group's most (at least two: a lone token's rows take another kernel): a
    row's numbers are then those of `_causal_attention` alone, since its products' columns are the same and rows do
    not change with their count (`rows_independent_bmm`). With `per_token`, or a prompt too long for the bound
    alone, a prompt runs `_causal_attention` itself. The plan (groups, index rows, masks) is made once per prefill."""

    def __init__(self, first: int, own_at: list[int], seq_at: list[int], lens: list[int], heads: int,
                 per_token: bool, device: torch.device):  # fmt: skip
        self.first, self.own_at, self.seq_at, self.lens, self.per_token = first, own_at, seq_at, lens, per_token
        by_width: dict[int, list[list[int]]] = {}
        longest: dict[int, int] = {}  # the longest prompt of each width's last group: its padded shape, kept as we go
        for i, n in enumerate(lens):
            cols = -(-n // KV_ALIGN)
            groups = by_width.setdefault(cols, [])
            joined = max(longest.get(cols, 0), n)
            if groups and not per_token and (len(groups[-1]) + 1) * self._cells(joined, heads) <= BATCHED_SCORES:
                groups[-1].append(i)
                longest[cols] = joined
            else:
                groups.append([i])
                longest[cols] = n
        self.groups = [
            (g, None if per_token or self._size(g, heads) > BATCHED_SCORES else [t.to(device) for t in self._plan(g)])
            for groups in by_width.values()
            for g in groups
        ]

    def _padded(self, longest: int) -> tuple[int, int]:
        """(queries, key columns) each prompt of a group whose longest prompt has `longest` tokens is padded to."""
        return max(2, longest - self.first), -(-longest // KV_ALIGN) * KV_ALIGN

    def _shape(self, group: list[int]) -> tuple[int, int]:
        """(queries, key columns) each prompt of `group` is padded to."""
        return self._padded(max(self.lens[i] for i in group))

    def _cells(self, longest: int, heads: int) -> int:
        """Scores per prompt of a group whose longest prompt has `longest` tokens."""
        m, width = self._padded(longest)
        return m * heads * width

    def _size(self, group: list[int], heads: int) -> int:
        return len(group) * self._cells(max(self.lens[i] for i in group), heads)

    def _plan(self, group: list[int]) -> tuple[torch.Tensor, ...]:
        """Where the group's queries and keys come from (rows) and go in its padded layout (slots); which columns
        each padded query sees (query j of every prompt sits at position first + j; padded queries see key 0)."""
        (m, width), own = self._shape(group), [self.lens[i] - self.first for i in group]
        q_rows = torch.cat([torch.arange(self.own_at[i], self.own_at[i] + n) for i, n in zip(group, own)])
        q_slot = torch.cat([torch.arange(j * m, j * m + n) for j, n in enumerate(own)])
        k_rows = torch.cat([torch.arange(self.seq_at[i], self.seq_at[i] + self.lens[i]) for i in group])
        k_slot = torch.cat([torch.arange(j * width, j * width + self.lens[i]) for j, i in enumerate(group)])
        hidden = torch.arange(width) > torch.arange(self.first, self.first + m)[:, None]  # [m, width]
        return q_rows, q_slot, k_rows, k_slot, hidden

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, out: torch.Tensor) -> None:
        for group, plan in self.groups:
            if plan is not None:
                self._batched(group, plan, q, k, v, scaling, out)
                continue
            for i in group:
                n, o, a = self.lens[i], self.own_at[i], self.seq_at[i]
                own = slice(o, o + n - self.first)
                _causal_attention(q[own], k[a : a + n], v[a : a + n], self.first, scaling, out[own], self.per_token)

    def _batched(self, group: list[int], plan: list[torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scaling: float, out: torch.Tensor) -> None:  # fmt: skip
        (P, (m, width)), (q_rows, q_slot, k_rows, k_slot, hidden) = (len(group), self._shape(group)), plan
        heads, d, kv_heads = q.shape[1], q.shape[2], k.shape[1]
        rep = heads // kv_heads
        # [P * kv_heads, rep * m, d]: a key head's query heads one after another, each over the group's m queries
        qs = _pad(q.index_select(0, q_rows), q_slot, P, m).view(P * kv_heads, rep * m, d)
        # [P * kv_heads, width, d], zeros past each prompt's keys
        kvs = [_pad(t.index_select(0, k_rows), k_slot, P, width).view(P * kv_heads, width, d) for t in (k, v)]
        bias = torch.zeros(m, width, dtype=q.dtype, device=q.device).masked_fill_(hidden, float("-inf"))
        scores = torch.bmm(qs, kvs[0].transpose(1, 2)).view(P * kv_heads, rep, m, width)
        probs = torch.softmax(scores.mul_(scaling).add_(bias), dim=-1)
        o = value_sum(probs.view(P * kv_heads, rep * m, width), kvs[1]).view(P, kv_heads, rep, m, d)
        out.index_copy_(0, q_rows, o.permute(0, 3, 1, 2, 4).reshape(P * m, heads * d).index_select(0, q_slot))


@functools.lru_cache(maxsize=None)
def rows_independent_bmm(head_dim: int, rep: int, threads: int, dtype: torch.dtype = torch.float32) -> bool:
    """Whether this CPU's batched matmul gives a row the same bits whatever the rows beside it, measured for prefill
    attention's two products (queries x keys over `head_dim`, weights x values over KV_ALIGN-padded keys) at row
    counts from two tokens' worth (`2 * rep`; `_causal_attention` never runs a lone token's rows alone) to 256 and
    at two offsets, against one large call. MKL's AVX-512 kernels pass; its AVX2 kernels may give a lone token's
    few rows other bits (hence the company), and where larger counts differ too prefill runs `per_token`.
    `threads`: the caller's torch thread count, a key of the cache only (the answer may depend on it); `dtype`: the
    model's (bf16 products take other kernels)."""
    gen = torch.Generator().manual_seed(0)
    width, heads, rows = 4 * KV_ALIGN, 3, 256 * rep + rep
    q, keys = (torch.randn(heads, n, head_dim, generator=gen).to(dtype) for n in (rows, width))
    weights, values = (
        torch.rand(heads, rows, width, generator=gen).to(dtype),
        torch.randn(heads, width, head_dim, generator=gen).to(dtype),
    )
    for a, b in ((q, keys.transpose(1, 2)), (weights, values)):
        whole = torch.bmm(a, b)
        for m in (2 * rep, 3 * rep, 8 * rep, 16 * rep, 32 * rep, 64 * rep, 256 * rep):
            for offset in (0, rep):
                if not torch.equal(torch.bmm(a[:, offset : offset + m], b), whole[:, offset : offset + m]):
                    return False
    return True


@functools.lru_cache(maxsize=None)
def padded_sums_exact(head_dim: int, rows: int, threads: int, dtype: torch.dtype = torch.float32) -> bool:
    """Whether this CPU's batched matmul gives a row of attention weights x values the same bits at every width of
    whole KV_ALIGN columns up to VALUE_CHUNK, the weights past its keys zero (what `value_sum` relies on): measured
    for rows of 5 to VALUE_CHUNK keys, `rows` query rows a product, the weights whole or a chunk of wider ones.
    `threads`: a key of the cache only."""
    gen = torch.Generator().manual_seed(0)
    weights = torch.rand(3, rows, 2 * VALUE_CHUNK, generator=gen).to(dtype)
    values = torch.randn(3, VALUE_CHUNK, head_dim, generator=gen).to(dtype)
    for keys in (5, KV_ALIGN + 1, 2 * KV_ALIGN + 7, VALUE_CHUNK - 3, VALUE_CHUNK):
        w = weights.clone()
        w[..., keys:] = 0
        first = -(-keys // KV_ALIGN) * KV_ALIGN
        want = torch.bmm(w[..., :first].contiguous(), values[:, :first])
        for width in range(first, VALUE_CHUNK + 1, KV_ALIGN):
            for chunk in (w[..., :width].contiguous(), w[..., :width]):
                if not torch.equal(torch.bmm(chunk, values[:, :width]), want):
                    return False
    return True


# oneDNN's bf16 kernels change a row's sums above 32 rows (they block the rows otherwise; measured with AMX), so
# `_Linear` runs bf16 inputs 32 rows at a time. `precision.serving_dtype` checks that this keeps rows exact on the
# CPU at hand before `--dtype auto` picks bf16.
BF16_ROWS = 32


def packs_weights(dtype: torch.dtype) -> bool:
    """Whether `_Linear` can hold `dtype` weights as oneDNN-packed copies on this CPU (see `FastRunner`)."""
    return torch.backends.mkldnn.is_available() and (
        dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


# Batch sizes `weight_matmuls` checks against each row alone: the small counts where kernels switch blocking and
# both sides of 16 and 32, out of `EXACT_MOST` rows.
EXACT_COUNTS = (2, 3, 5, 8, 16, 17, 32, 33, 40)
EXACT_MOST = 40


@functools.lru_cache(maxsize=None)
def weight_matmuls(hidden: int, intermediate: int, dtype: torch.dtype, threads: int) -> tuple[bool, bool, str]:
    """How a CPU server runs its weight matmuls for a model of MLP sizes `hidden` -> `intermediate` in `dtype`:
    (oneDNN-packed, rows exact, the reason for the log). Packed where this CPU packs `dtype` and the packed matmuls
    give every row of a batch the bits it gets alone (`rows_exact` at `EXACT_COUNTS` rows); else the plain matmul
    where that does; else the first of the two this CPU has, rows not exact. Measured once per process and `threads`
    (the caller's torch thread count: a kernel's blocking may depend on it)."""
    kinds = [True, False] if packs_weights(dtype) else [False]
    names = {True: "oneDNN-packed", False: "plain (torch.mm, F.linear)"}
    for pack in list(kinds):
        try:
            linears = probe_linears(hidden, intermediate, dtype, pack)
        except (RuntimeError, NotImplementedError) as e:  # a oneDNN build that cannot pack on this CPU: plain only
            log.info("weight matmuls: oneDNN cannot pack %s weights here (%s)", dtype, str(e).splitlines()[0][:200])
            kinds.remove(pack)
            continue
        if rows_exact(linears, EXACT_COUNTS, EXACT_MOST):
            return pack, True, f"{names[pack]}, each row's bits the same at any batch (measured at start-up)"
    tried = " and ".join(names[k] for k in kinds)
    why = (f"{names[kinds[0]]}; on this CPU the {tried} matmuls give a row other bits beside other rows (measured at "
           "start-up), so a seeded request samples the same tokens only in the same batch")  # fmt: skip
    return kinds[0], False, why


def probe_linears(hidden: int, intermediate: int, dtype: torch.dtype, pack: bool = True) -> list:
    """`_Linear`s as a CPU runner builds them (oneDNN-packed with `pack`) over seeded weights of a model's MLP shapes:
    what `weight_matmuls` and `precision.serving_dtype` measure. Unpacked, the lm_head keeps the model's [out, in]
    layout (a tied lm_head's weight is the embedding's) and so runs another matmul than the layers' transposed ones:
    a third probe, of the lm_head's input width, runs that one."""
    gen = torch.Generator().manual_seed(0)
    out = []
    shapes = [(hidden, 2 * intermediate, True), (intermediate, hidden, True)]
    if not pack:  # packed, every weight takes the same path
        shapes.append((hidden, 2 * intermediate, False))
    for n_in, n_out, transpose in shapes:
        module = torch.nn.Linear(n_in, n_out, bias=False)
        module.weight.data = (torch.randn(n_out, n_in, generator=gen) / n_in**0.5).to(dtype)
        linear = _Linear([module], transpose=transpose, pack=pack)
        linear.refresh()
        out.append(linear)
    return out


@torch.inference_mode()
def rows_exact(linears: list, counts: Optional[Sequence[int]] = None, most: int = 100) -> bool:
    """Whether each of `linears` (`probe_linears`) gives every row of a batch the bits it gets alone, for batches of
    `counts` rows (by default every batch of 2 to two bf16 chunks and one row, `BF16_ROWS`, and `most`) out of `most`
    rows."""
    counts = [*range(2, 2 * BF16_ROWS + 2), most] if counts is None else counts
    gen = torch.Generator().manual_seed(1)
    for linear in linears:
        x = torch.randn(most, linear.weight.shape[1], generator=gen).to(linear.weight.dtype)
        alone = torch.cat([linear(x[i : i + 1]) for i in range(most)])
        for m in counts:
            if not torch.equal(linear(x[:m]), alone[:m]):
                return False
    return True


# oneDNN's packed float32 linear weight, as its reorder lays it out here: [out/64][in/16][16 in][64 out] (its
# AB16b64a format). A weight update rewrites a packed copy in place as this permuted view of the weight, a plain
# torch copy several times faster than oneDNN's reorder (which also allocates a new copy each time: the server
# re-packs ~0.5 GB every step). `_packed_blocks` trusts it only where the first packing's bytes are exactly these.
PACK_OUT, PACK_IN = 64, 16


def _blocked(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] viewed in the packed layout's order [out/64, in/16, 16, 64] (no copy)."""
    n, k = weight.shape
    return weight.view(n // PACK_OUT, PACK_OUT, k // PACK_IN, PACK_IN).permute(0, 2, 3, 1)


def _packed_blocks(packed: torch.Tensor, weight: torch.Tensor) -> Optional[torch.Tensor]:
    """A writable tensor over `packed`'s memory in `_blocked`'s shape, where `packed` (oneDNN's packing of
    `weight`) holds exactly `_blocked(weight)`'s values in that order; else None (another dtype, CPU or oneDNN
    picks another format, or sizes that do not divide into blocks)."""
    n, k = weight.shape
    if weight.dtype != torch.float32 or n % PACK_OUT or k % PACK_IN:
        return None
    try:  # a torch build without these ops packs anew each time, as before
        nbytes, address = torch.ops.mkldnn._nbytes(packed), torch.ops.mkldnn.data_ptr(packed)
    except (AttributeError, RuntimeError):
        return None
    if nbytes != weight.numel() * weight.element_size():
        return None
    memory = (ctypes.c_char * nbytes).from_address(address)
    blocks = torch.frombuffer(memory, dtype=torch.float32).view(n // PACK_OUT, k // PACK_IN, PACK_IN, PACK_OUT)
    return blocks if torch.equal(blocks, _blocked(weight)) else None


class _Linear:
    """`modules` (`nn.Linear`s of one input) as one matmul. Their weights are stored once, fused, and each module's
    parameters are re-bound as views of that storage, so a weight update (`copy_` into the parameters) updates this
    matmul and the model's own forward still works. With `pack` (a CPU with oneDNN), a oneDNN-reordered copy of the
    weight serves every input, whatever its rows: oneDNN computes each float32 row the same way at any batch size of
    two rows or more (one row takes another kernel on AVX-512 CPUs, so it runs as two; bf16 runs `BF16_ROWS` rows at
    a time), while MKL's result for a row changes with the row count. That is what makes the server batch-invariant
    (module docstring), and oneDNN beats MKL on decode batches too, the lm_head most; `refresh()` (re)builds the
    copy. Without it, with `transpose`, the weight is stored as [in, out] row-major (MKL streams that layout faster
    for the few rows of a decode step)."""

    def __init__(self, modules: list[Any], transpose: bool = False, pack: bool = False, own: bool = False):
        weights = [m.weight.detach() for m in modules]
        self.wt: Optional[torch.Tensor] = None
        if transpose and not pack:
            self.wt = torch.cat([w.t() for w in weights], dim=1).contiguous()
            self.weight = self.wt.t()
        elif len(weights) == 1:
            # `own`: a copy of its own, as the fused weights have (`utils.device.own_file_backed` says why)
            self.weight = weights[0].clone() if own else weights[0]
        else:
            self.weight = torch.cat(weights, dim=0)
        biases = [m.bias for m in modules]
        self.bias = None if any(b is None for b in biases) else torch.cat([b.detach() for b in biases])
        if self.wt is not None or len(modules) > 1 or own:
            offset = 0
            for m in modules:
                rows = m.weight.shape[0]
                m.weight = torch.nn.Parameter(self.weight[offset : offset + rows], requires_grad=False)
                if self.bias is not None:
                    m.bias = torch.nn.Parameter(self.bias[offset : offset + rows], requires_grad=False)
                offset += rows
        self.pack = pack
        self.packed: Optional[torch.Tensor] = None  # built by `refresh()` (the runner's, once all weights are set)
        self._blocks: Optional[torch.Tensor] = None  # the packed copy's memory, where its layout is `_blocked`'s

    def refresh(self) -> None:
        """Rebuild the packed copy after the weights changed: rewritten in place where its layout is known (the
        first packing checks it: `_packed_blocks`), else packed again by oneDNN."""
        if self._blocks is not None:
            self._blocks.copy_(_blocked(self.weight))
            return
        self.packed = None
        if self.pack:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.contiguous(), None)
            self._blocks = _packed_blocks(self.packed, self.weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            rows = x.shape[:-1].numel()
            if rows == 1:
                # A lone row takes another oneDNN kernel, whose sums differ in the last bit wherever the inputs are
                # 1536 wide or more (AVX-512 CPUs: measured; any count of rows from 2 up agrees): give it company.
                two = x.reshape(1, -1).expand(2, -1).contiguous()
                y = torch.ops.mkldnn._linear_pointwise(two, self.packed, self.bias, "none", [], "")
                return y[:1].reshape(*x.shape[:-1], -1)
            if x.dtype == torch.bfloat16 and rows > BF16_ROWS:
                flat = x.reshape(rows, -1)
                parts = [self(flat[i : i + BF16_ROWS]) for i in range(0, rows, BF16_ROWS)]
                return torch.cat(parts).reshape(*x.shape[:-1], -1)
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.wt is not None:
            return torch.mm(x, self.wt) if self.bias is None else torch.addmm(self.bias, x, self.wt)
        return F.linear(x, self.weight, self.bias)


class _Layer:
    """One decoder layer's tensors, q/k/v and gate/up fused."""

    def __init__(self, layer: Any, cpu: bool, pack: bool):
        attn, mlp = layer.self_attn, layer.mlp
        self.ln1, self.ln2 = layer.input_layernorm, layer.post_attention_layernorm
        self.qkv = _Linear([attn.q_proj, attn.k_proj, attn.v_proj], transpose=cpu, pack=pack)
        self.o = _Linear([attn.o_proj], transpose=cpu, pack=pack, own=cpu)
        self.gate_up = _Linear([mlp.gate_proj, mlp.up_proj], transpose=cpu, pack=pack)
        self.down = _Linear([mlp.down_proj], transpose=cpu, pack=pack, own=cpu)
        self.linears = [self.qkv, self.o, self.gate_up, self.down]
        self.scaling = float(attn.scaling)


class FastRunner:
    """Prefill and decode for a `supports`-ed model (see the module docstring)."""

    def __init__(self, model: Any):
        cfg = model.config
        self.model = model
        self.inner = model.model
        cpu = next(model.parameters()).device.type == "cpu"
        dtype = model.model.embed_tokens.weight.dtype
        threads = torch.get_num_threads()  # what is measured below is this CPU's at the computing thread's count
        # oneDNN copies (weights held twice) on CPU, for every matmul of the layers and the lm_head, where they keep a
        # row's bits independent of its batch (`weight_matmuls`). oneDNN packs bf16 weights only where the CPU has
        # bf16 instructions (AVX-512 BW/VL/DQ or AVX-NE-CONVERT); elsewhere bf16 runs the plain matmuls.
        packed, self.batch_invariant = False, False  # a GPU makes no such promise (module docstring)
        if cpu:
            packed, self.batch_invariant, why = weight_matmuls(cfg.hidden_size, cfg.intermediate_size, dtype, threads)
            (log.info if self.batch_invariant else log.warning)("weight matmuls: %s", why)
        self.layers = [_Layer(layer, cpu, packed) for layer in self.inner.layers]
        if cpu:  # what the fusion left in the checkpoint's mapping (embeddings, norms), before the lm_head takes
            own_file_backed(model)  # its weight: else updates copy it on write, and the file stays resident
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.inter = cfg.intermediate_size
        self.lm_head = _Linear([model.lm_head], pack=packed)
        rep = self.heads // self.kv_heads
        self.per_token_attention = cpu and not rows_independent_bmm(self.head_dim, rep, threads, dtype)
        if cpu and self.batch_invariant and not padded_sums_exact(self.head_dim, rep, threads, dtype):
            self.batch_invariant = False
            log.warning("attention: this CPU's batched matmul sums a row's values otherwise beside wider rows")
        weight = self.inner.embed_tokens.weight
        self.dtype, self.device = weight.dtype, weight.device
        self.refresh()  # packed only now: the file's pages and the packed copies are never resident together
        _return_freed_memory()  # transients of the fusion and packing kept by malloc

    def refresh(self) -> None:
        """Call after the model's weights changed in place (a weight update)."""
        for linear in [self.lm_head] + [lin for layer in self.layers for lin in layer.linears]:
            linear.refresh()

    def new_kv(self, max_rows: int = 0) -> StaticKV:
        """An empty cache for a running batch of (usually) at most `max_rows` rows."""
        return StaticKV(len(self.layers), self.kv_heads, self.head_dim, self.dtype, self.device, max_rows)

    def _rope_tables(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.inner.rotary_emb(x, positions[None, :])
        return cos[0][:, None, :], sin[0][:, None, :]  # [N, 1, D]

    def _qkv(self, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n, d = x.shape[0], self.head_dim
        qkv = layer.qkv(_rms_norm(x, layer.ln1))
        qk, v = qkv.split([(self.heads + self.kv_heads) * d, self.kv_heads * d], dim=-1)
        # q and k side by side through one rotation (the same operations on every element as two): half the calls
        q, k = _rope(qk.view(n, self.heads + self.kv_heads, d), cos, sin).split([self.heads, self.kv_heads], dim=1)
        return q, k, v.view(n, self.kv_heads, d)

    def _finish_layer(self, layer: _Layer, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Attention output projection, residual, MLP, residual; updates `x` (this forward's own tensor) in place."""
        x.add_(layer.o(attn))
        gate, up = layer.gate_up(_rms_norm(x, layer.ln2)).split(self.inter, dim=-1)
        return x.add_(layer.down(F.silu(gate, inplace=True).mul_(up)))  # in place: no new [tokens, 2 x inter]

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(_rms_norm(x, self.inner.norm))

    def prefill(self, prompts: list[list[int]]) -> tuple[PrefillKV, torch.Tensor]:
        """Run `prompts`. Returns their keys/values (newest token first) and last-position logits [B, V].

        Packed: projections and MLPs run on the real tokens only, attention over each prompt's own keys. The tokens
        every prompt starts with (a shared system prompt, a chat template's start) run once, and each prompt's own
        tokens attend over those keys and theirs (SGLang's radix cache shares such prefixes too). Exact, because a
        token's attention has the same numbers whether its prompt's start ran in the same call or apart, and
        whichever prompts share its batch (`_causal_attention`, `_PromptsAttention`).
        """
        lens = [len(p) for p in prompts]
        B, L, dev = len(lens), max(lens), self.device
        s = shared_start(prompts)
        # packed: the shared start once, then each prompt's own tokens
        ids = torch.tensor(prompts[0][:s] + [t for p in prompts for t in p[s:]], device=dev)
        pos = torch.cat([torch.arange(s)] + [torch.arange(s, n) for n in lens]).to(dev)
        own_at = [s + sum(n - s for n in lens[:i]) for i in range(B)]  # where each prompt's own tokens are packed
        seq_at = [sum(lens[:i]) for i in range(B)]  # where each prompt's whole sequence starts, below
        # the packed rows of each prompt's whole sequence (the shared start's, then its own), prompt after prompt
        src = _sequences(s, own_at, lens).to(dev) if s else None
        # where each prompt's tokens go in the cache's layout: its last token first, its first at n - 1
        slot = torch.cat([torch.arange(i * L + n - 1, i * L - 1, -1) for i, n in enumerate(lens)]).to(dev)
        mask = torch.zeros(B * L, dtype=torch.bool, device=dev).index_fill_(0, slot, True).view(B, L)
        x = F.embedding(ids, self.inner.embed_tokens.weight)
        cos, sin = self._rope_tables(x, pos)
        prompts_attention = _PromptsAttention(s, own_at, seq_at, lens, self.heads, self.per_token_attention, dev)
        keys, values = [], []
        for layer in self.layers:
            q, k, v = self._qkv(layer, x, cos, sin)
            seq_k, seq_v = (k, v) if src is None else (k.index_select(0, src), v.index_select(0, src))
            keys.append(_pad(seq_k, slot, B, L))
            values.append(_pad(seq_v, slot, B, L))
            attn = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
            if s:  # the shared start, over itself
                _causal_attention(q[:s], k[:s], v[:s], 0, layer.scaling, attn[:s], self.per_token_attention)
            prompts_attention(q, seq_k, seq_v, layer.scaling, attn)  # each prompt's own tokens, over its sequence
            x = self._finish_layer(layer, x, attn)
        last = torch.tensor([o + n - s - 1 for o, n in zip(own_at, lens)], device=dev)
        return PrefillKV(keys, values, mask), self._logits(x.index_select(0, last))

    def decode(self, batch: Any) -> torch.Tensor:
        """Feed every row's newest token (`batch.next_ids`, at `batch.pos`); returns the next logits [B, V]. Advances
        the positions; the caller samples the new `next_ids`. Grouped heads attend without repeating keys: the query
        heads that share a key head are passed as that head's queries (transformers' one-token `pack_gqa`), over a
        strided view of the cache."""
        kv: StaticKV = batch.kv
        col = kv.append_column()
        n, d, rep = kv.n, self.head_dim, self.heads // self.kv_heads
        # One query per row: two small batched matmuls and a softmax, with the padding mask added once per step
        # (sdpa's CPU kernel costs more at these sizes: one query a row, tens of keys).
        # Every row's keys start at the window's first column (newest first), and the window is a whole number of
        # KV_ALIGN columns: a row's scores, softmax and sum over values then come out of the same kernel blocks,
        # bit for bit, whatever the other rows' lengths (StaticKV's docstring).
        window = kv.window_mask()
        cols = kv.aligned_width()
        bias = torch.full((n, cols), float("-inf"), dtype=self.dtype, device=self.device)
        bias[:, : window.shape[1]].masked_fill_(window, 0.0)
        bias = bias[:, None, None, :]
        x = F.embedding(batch.next_ids, self.inner.embed_tokens.weight)
        cos, sin = self._rope_tables(x, batch.pos)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, cos, sin)
            kv.keys[i][:n, :, col] = k
            kv.values[i][:n, :, col] = v
            keys = kv.keys[i][:n, :, kv.start : kv.start + cols]
            values = kv.values[i][:n, :, kv.start : kv.start + cols]
            scores = torch.matmul(q.view(n, self.kv_heads, rep, d), keys.transpose(-1, -2))
            probs = torch.softmax(scores.mul_(layer.scaling).add_(bias), dim=-1)
            out = value_sum(probs, values)
            x = self._finish_layer(layer, x, out.reshape(n, self.heads * d))
        batch.pos = batch.pos + 1
        return self._logits(x)


def make_runner(model: Any, fast: bool = True) -> Any:
    """The fastest runner for `model`: `FastRunner` where it reproduces the model's forward (and `fast`), else
    `batch.HFRunner`, the model's own forward."""
    return FastRunner(model) if fast and supports(model) else HFRunner(model)
