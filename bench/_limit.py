"""How close generation (or an update) comes to the CPU's compute limit: its FLOPs over the FLOP/s of a big matmul.

- FLOPs are counted, not profiled: 2 per multiply-add of every matmul a Llama-style decoder runs (q/k/v/o, the gated
  MLP, the LM head, attention's scores and weighted values). Norms, rotary, biases, softmax, activations and sampling
  are left out: they are O(hidden) per token against O(hidden^2) for the matmuls, well under 1% for SmolLM2.
- The count is the least work the workload needs: the prompts' shared start once, each row's own prompt tokens once,
  the LM head only where a token is sampled. A server that repeats work (a shared start prefilled per batch, padding)
  gets no credit for it: that shows as a lower fraction, which is the point.
  An update (`update_flops`) counts its forward the same way, and its backward as two forwards.
- The limit is measured, not read off a datasheet: `torch.mm` of two large square matrices in this process, at the
  thread count and on the cores the systems get. It runs the same kernels (oneDNN/MKL) as the model's linear layers
  and picks AVX2 or AVX-512 as they do, so it is what this CPU attains, not a clock x width figure it never reaches.
- It is a compute ceiling, not a roofline: a decode step's matmuls are skinny (a few rows x the weights) and may be
  bound by memory bandwidth well below it. A fraction near 1 is not to be expected; its trend is what to watch.
- What the kernels themselves reach at the decode's row count (`measure_kernel_gflops`): one pass of that many rows
  through every weight matmul of the model's shapes, with the fast path's own `_Linear` (oneDNN-packed on CPU). A
  decode step on those kernels gets no closer to the limit (prefill's many rows can): how much of the gap is theirs.
"""

from __future__ import annotations

import statistics
import time
from typing import Optional, Sequence, Union

import torch


def _keys(first: int, end: int) -> int:
    """Keys attended over by the tokens at positions first .. end - 1 (position i attends to i + 1 keys)."""
    return (end * (end + 1) - first * (first + 1)) // 2


def _dims(config) -> tuple[int, int, int, int, int, int]:
    """(hidden, intermediate, layers, heads, kv_heads, head_dim) of the Llama-style decoder `config` describes."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads  # older configs: no grouped-query attention
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return hidden, config.intermediate_size, config.num_hidden_layers, heads, kv_heads, head_dim


def matmul_flops(config) -> tuple[int, int, int]:
    """FLOPs of (one token through every layer's matmuls, one LM-head call, attention per (token, key) pair over all
    layers) for the Llama-style decoder `config` describes (a transformers config)."""
    hidden, inter, layers, heads, kv_heads, head_dim = _dims(config)
    # multiply-adds of one token through one layer: q, k, v (k and v narrower under GQA), o, gate, up, down
    per_layer = hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
    per_layer += 3 * hidden * inter
    # the LM head counts once per sampled token (a tied embedding counts here only); attention: scores, then values
    return 2 * layers * per_layer, 2 * hidden * config.vocab_size, 2 * 2 * heads * head_dim * layers


def decode_flops(config, rows: int, prompt_len: Union[int, Sequence[int]], new_tokens: int,
                 shared_prefix: int = 0) -> dict:  # fmt: skip
    """FLOPs of sampling `new_tokens` tokens for each of `rows` rows from prompts of `prompt_len` tokens (or one length
    per row), whose first `shared_prefix` tokens are the same in every row and are prefilled once, with the Llama-style
    decoder `config` describes (a transformers config).

    Prefill runs every prompt token through the layers (the shared start once) and the LM head on each row's last
    prompt token, which samples the row's first token. Decode runs `new_tokens - 1` steps per row: the previous token
    through the layers and the LM head; the last sampled token is never fed back. So every generated token costs one
    LM head and one pass through the layers (the first one's pass is its row's last prompt position, in prefill).
    Attention for a token at position i, per layer: 2 * 2 * heads * head_dim * (i + 1) (scores, then weighted values).

    Returns {"prefill", "decode", "total", "attention" (the part of total in attention), "per_token_matmul" (one
    generated token's matmuls, attention excluded: 2 * (layers * per-layer weights + hidden * vocab))}."""
    lens = [prompt_len] * rows if isinstance(prompt_len, int) else list(prompt_len)
    if len(lens) != rows or new_tokens < 1 or not 0 <= shared_prefix < min(lens):
        # every row keeps its last prompt token of its own: that position's logits sample the row's first token
        raise ValueError(f"rows {rows}, prompt lengths {lens}, new_tokens {new_tokens}, shared_prefix {shared_prefix}")
    body, head, per_key = matmul_flops(config)
    prefill_tokens = shared_prefix + sum(n - shared_prefix for n in lens)
    prefill_keys = _keys(0, shared_prefix) + sum(_keys(shared_prefix, n) for n in lens)
    decode_keys = sum(_keys(n, n + new_tokens - 1) for n in lens)
    prefill = prefill_tokens * body + rows * head + prefill_keys * per_key
    decode = rows * (new_tokens - 1) * (body + head) + decode_keys * per_key
    return {"prefill": prefill, "decode": decode, "total": prefill + decode,
            "attention": (prefill_keys + decode_keys) * per_key, "per_token_matmul": body + head}  # fmt: skip


def update_flops(config, groups: int, group_size: int, prompt: int, completion: int, common_start: int = 0) -> dict:
    """FLOPs of one PPO update (forward and backward) of the Llama-style decoder `config` describes on a GRPO batch:
    `groups` prompts of `prompt` tokens, their first `common_start` shared by all, each with `group_size` completions
    of `completion` policy tokens, counted as the least the update needs (the kit's packing, bench/update_speed.py):
    the common start once, each prompt's own tokens once for its group, every completion token but the last (no token
    follows it), and the LM head once for each logit that scores a policy token (a prompt's last position once for its
    group). A backward pass costs two forwards (the gradients of the inputs and of the weights): 3 x the forward.

    Returns {"forward", "total", "attention" (the part of total in attention), "positions", "lm_head_positions"}."""
    if not 0 <= common_start < prompt or completion < 1 or groups < 1 or group_size < 1:
        raise ValueError(f"groups {groups}, group_size {group_size}, prompt {prompt}, completion {completion}, "
                         f"common_start {common_start}")  # fmt: skip
    body, head, per_key = matmul_flops(config)
    rows = groups * group_size
    positions = common_start + groups * (prompt - common_start) + rows * (completion - 1)
    lm_head = groups + rows * (completion - 1)
    keys = _keys(0, common_start) + groups * _keys(common_start, prompt) + rows * _keys(prompt, prompt + completion - 1)
    forward = positions * body + lm_head * head + keys * per_key
    return {"forward": forward, "total": 3 * forward, "attention": 3 * keys * per_key, "positions": positions,
            "lm_head_positions": lm_head}  # fmt: skip


def measure_peak_gflops(threads: int, dtype: torch.dtype = torch.float32, seconds: float = 2.0, n: int = 1024) -> float:
    """GFLOP/s of `torch.mm` on two n x n `dtype` matrices at `threads` torch threads, in this process (bind it to the
    cores first: the caller's affinity is used as is). One warm-up product (thread pool start, kernel selection),
    then products for about `seconds`. torch's thread count is restored afterwards.

    Measured rather than taken from a datasheet because the model's linear layers go through the same path (ATen ->
    oneDNN/MKL) and pick the same vector ISA (AVX2 or AVX-512, bf16 native or emulated), so this is the matmul speed
    that code can attain on these cores; a peak from clock x vector width is never reached and says nothing about
    bf16 emulated on AVX2."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)
        a, b = (torch.randn(n, n, generator=gen).to(dtype) for _ in range(2))
        out = torch.empty(n, n, dtype=dtype)
        with torch.inference_mode():
            torch.mm(a, b, out=out)
            reps, t0 = 0, time.perf_counter()
            while True:
                torch.mm(a, b, out=out)  # out=: no allocation in the timed loop
                reps += 1
                elapsed = time.perf_counter() - t0
                if elapsed >= seconds:
                    break
        return 2 * n**3 * reps / elapsed / 1e9
    finally:
        torch.set_num_threads(before)


def measure_kernel_gflops(
    config, rows: int, threads: int, dtype: torch.dtype = torch.float32, repeats: int = 5
) -> float:
    """GFLOP/s of `rows` rows through one decode step's weight matmuls at `threads` torch threads: every layer's
    fused q/k/v, o, fused gate/up and down, each with its own weight (so the weights stream from memory as in a
    step), then the LM head; random weights of the shapes `config` describes (a transformers config), each through
    `areal_lite.kit.server.fastpath._Linear`, the embedded server's own matmul (oneDNN-packed where it packs). Best of
    `repeats` passes after one warm-up; torch's thread count is restored afterwards. Attention, norms and sampling
    are left out: this is the kernels' ceiling at this row count, not a decode step."""
    from types import SimpleNamespace

    from areal_lite.kit.server.fastpath import _Linear, packs_weights

    hidden, inter, layers, heads, kv_heads, head_dim = _dims(config)
    shapes = [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim), (2 * inter, hidden),
              (hidden, inter)] * layers + [(config.vocab_size, hidden)]  # fmt: skip
    pack = packs_weights(dtype)
    gen = torch.Generator().manual_seed(0)
    linears = []
    for out_features, in_features in shapes:
        linear = _Linear([SimpleNamespace(weight=torch.randn(out_features, in_features, generator=gen).to(dtype),
                                          bias=None)], pack=pack)  # fmt: skip
        linear.refresh()
        if linear.packed is not None:
            linear.weight = None  # the packed copy is what runs: one copy of the weights in memory
        linears.append((linear, torch.randn(rows, in_features, generator=gen).to(dtype)))
    body, head, _ = matmul_flops(config)  # the same count as the workload's: these shapes' multiply-adds x 2
    flops = rows * (body + head)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            best = float("inf")
            for i in range(repeats + 1):  # the first pass warms up (thread pool, kernel selection): not counted
                t0 = time.perf_counter()
                for linear, x in linears:
                    linear(x)
                if i:
                    best = min(best, time.perf_counter() - t0)
        return flops / best / 1e9
    finally:
        torch.set_num_threads(before)


def against_limit(
    tokens_per_s: float,
    flops: dict,
    peak_gflops: float,
    kernel_gflops: Optional[float] = None,
    paired: Optional[Sequence[tuple[float, float]]] = None,
) -> dict:
    """A generation run against the limit: achieved GFLOP/s = `tokens_per_s` x the workload's FLOPs per token (=
    total FLOPs / wall seconds, for a run that makes the workload's tokens); `flops` as `decode_flops` returns it,
    with the workload's generated "tokens" added. `kernel_gflops` (`measure_kernel_gflops`), when given, is kept
    beside it with its own fraction of the limit.

    `paired` ([(a run's tokens/s, the peak measured just before that run)]): the fraction is then the median of
    the runs' own fractions ("fraction_runs"), so a CPU whose speed drifts during a bench (a shared VM's does) is
    held against itself; pass the median peak as `peak_gflops`."""
    per_token = flops["total"] / flops["tokens"] / 1e9
    achieved = tokens_per_s * per_token
    out = {"peak_gflops": peak_gflops, "workload_flops": flops, "embedded_tok_s": tokens_per_s,
           "embedded_gflops": achieved, "fraction": achieved / peak_gflops}  # fmt: skip
    if paired:
        runs = [tok_s * per_token / peak for tok_s, peak in paired]
        out.update(fraction=statistics.median(runs), fraction_runs=runs, peak_runs=[peak for _, peak in paired])
    if kernel_gflops is not None:
        out.update(kernel_gflops=kernel_gflops, kernel_fraction=kernel_gflops / peak_gflops)
    return out


def fraction_line(limit: dict) -> str:
    """One printed line from `against_limit`'s result."""
    per_token = limit["workload_flops"]["total"] / limit["workload_flops"]["tokens"] / 1e9
    line = (f"{limit['embedded_gflops']:.1f} GFLOP/s = {limit['embedded_tok_s']:.1f} tok/s x {per_token:.3f} "
            f"GFLOP/token; limit (torch.mm peak) {limit['peak_gflops']:.1f} GFLOP/s; fraction of the limit "
            f"{limit['fraction']:.3f}")  # fmt: skip
    if "fraction_runs" in limit:
        peaks, runs = limit["peak_runs"], limit["fraction_runs"]
        line += (f" (the median of {len(runs)} runs' own, {min(runs):.3f}-{max(runs):.3f}, each over the peak "
                 f"measured just before it, {min(peaks):.1f}-{max(peaks):.1f} GFLOP/s)")  # fmt: skip
    if "kernel_gflops" in limit:
        line += (f"; the weight matmuls alone at the batch's rows {limit['kernel_gflops']:.1f} GFLOP/s, "
                 f"{limit['kernel_fraction']:.3f} of the limit")  # fmt: skip
    return line
