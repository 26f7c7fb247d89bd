"""Choosing each row's next token, its logprob, and whether the row is done, the way SGLang 0.5.23 does.

Design decisions
- Logprobs follow SGLang (python/sglang/srt/layers/sampler.py): `output_token_logprobs` is
  `log_softmax(logits / temperature)` at the sampled token, temperature applied, top-p/top-k truncation *not*;
  greedy rows (temperature < 1e-6) get `log_softmax(logits)`. With `original_logprob` (SGLang's
  `SGLANG_RETURN_ORIGINAL_LOGPROB=1`) it is `log_softmax(logits)` always. A trainer recomputing logprobs must get
  the same numbers from either server, so these rules are SGLang's, not the textbook's.
- Masks that change what can be sampled (EOS suppressed until `min_new_tokens`) and the frequency and presence
  penalties are applied before temperature and logprobs, as SGLang's penalizers are (`apply_penalties`).
- Batched draws (`draw`): rows with different temperatures, top-k and top-p share one softmax and one inverse-CDF draw,
  on CPU `CPU_SAMPLE_ROWS` rows at a time; greedy rows skip it. Each row brings its own uniform number from its own
  random stream (`GenerationState.rng`), so what a row samples does not depend on which rows share its batch.
- Reproducible by default (`RowSeeds`): with the fast path's batch-invariant logits (`fastpath.py`), the rollouts of
  a synchronous run repeat from run to run on the same machine, whatever the arrival order and batching. SGLang
  samples from one shared generator unless deterministic inference is on; a learner comparing two runs step by
  step needs the same samples, and a test of learning must not depend on how requests happened to be batched.
- Finish rules in SGLang's order: stop string, then stop token / EOS, then length.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections import OrderedDict
from typing import Any, Optional

import torch

from areal_lite.kit.server.protocol import GenerationState


class RowSeeds:
    """Gives each arriving row its random stream (see the module docstring); runs on the scheduler thread.

    A row's stream is seeded from the request's `sampling_seed` (SGLang's field) and its sample index when the client
    sends one; otherwise from the server's `--random-seed`, the request's content (prompt and sampling parameters)
    and how many identical requests came before it. Identical requests are interchangeable, so which of them gets
    which stream changes nothing.

    Identical requests are counted by a digest of their prompt and sampling parameters; the count is remembered for
    the `remember` most recent distinct requests (a long run's unique multi-turn prompts must not grow it forever;
    forgetting one restarts its count, which is as reproducible as the rest).
    """

    def __init__(self, server_seed: int, remember: int = 1 << 16):
        self.server_seed = int(server_seed)
        self.remember = remember
        self._seen: OrderedDict[bytes, int] = OrderedDict()

    def assign(self, s: GenerationState) -> None:
        if s.params.sampling_seed is not None:
            s.rng = random.Random(_digest(b"client", s.params.sampling_seed, s.sample))
            return
        key = _digest(b"request", s.prompt, dataclasses.astuple(s.params))
        count = self._seen.pop(key, 0)
        self._seen[key] = count + 1  # most recent last
        if len(self._seen) > self.remember:
            self._seen.popitem(last=False)
        s.rng = random.Random(_digest(b"server", self.server_seed, key, count))


def _digest(*parts: Any) -> bytes:
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


# Rows per pass on a CPU: a pass's logits (4 x 49k floats for SmolLM2, 0.8 MB) stay in the core's cache through its
# half-dozen steps over the vocabulary instead of the whole batch's streaming from memory at each (bit for bit the
# same: every step works row by row).
CPU_SAMPLE_ROWS = 4


def sample_tokens(
    logits: torch.Tensor, seqs: list[GenerationState], original_logprob: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of `logits` [B, V] (float32) and its logprob, with each row's own sampling parameters and
    random stream (`rng`, which sampled rows must have)."""
    B, step = logits.shape[0], CPU_SAMPLE_ROWS
    if logits.device.type != "cpu" or B <= step:
        return _sample_rows(logits, seqs, original_logprob)
    parts = [_sample_rows(logits[i : i + step], seqs[i : i + step], original_logprob) for i in range(0, B, step)]
    return torch.cat([t for t, _ in parts]), torch.cat([lp for _, lp in parts])


NOT_FINITE = "the next-token probabilities are not finite: the weights (or an update) hold NaN or inf"


def _sample_rows(
    logits: torch.Tensor, seqs: list[GenerationState], original_logprob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    B = logits.shape[0]
    apply_penalties(logits, seqs)
    greedy = [s.params.greedy for s in seqs]
    temps = [1.0 if g else s.params.temperature for g, s in zip(greedy, seqs)]
    scaled = logits if all(t == 1.0 for t in temps) else logits / torch.tensor(temps, device=logits.device)[:, None]
    logprobs_all = torch.log_softmax(logits if original_logprob else scaled, dim=-1)
    # argmax only where a row is greedy: over 49k entries a row it costs about as much as the softmax
    tokens = torch.argmax(logits, dim=-1) if any(greedy) else None
    if not all(greedy):
        rows = [i for i, g in enumerate(greedy) if not g]
        sub = [seqs[i] for i in rows]
        if original_logprob:
            probs = torch.softmax(scaled[rows] if len(rows) < B else scaled, dim=-1)
        else:  # softmax(scaled), from the pass already made: the same numbers whether greedy rows are beside it
            probs = (logprobs_all[rows] if len(rows) < B else logprobs_all).exp()
        # Only the rows that ask: top-p's float32 running sum can pass 1 before a row's tail, which would cut it
        cut = [j for j, s in enumerate(sub) if s.params.top_k != -1 or s.params.top_p < 1.0]
        if cut:
            probs[cut] = top_k_top_p(probs[cut], [sub[j] for j in cut])
        uniforms = torch.tensor([s.rng.random() for s in sub], dtype=torch.float64, device=probs.device)
        picked = draw(probs, uniforms)
        if tokens is None:
            tokens = picked
        else:
            tokens[rows] = picked
    logprobs = logprobs_all.gather(1, tokens[:, None]).flatten()
    if bool(logprobs.isnan().any()):  # a greedy row's argmax over NaN logits: token 0, as if it meant something
        raise ValueError(NOT_FINITE)
    # JSON has no -inf; SGLang clamps the same way.
    logprobs = logprobs.clamp(min=torch.finfo(logprobs.dtype).min)
    assert tokens.shape == (B,)
    return tokens, logprobs


def apply_penalties(logits: torch.Tensor, seqs: list[GenerationState]) -> None:
    """SGLang's penalizers, in place on `logits` [B, V]: until `min_new_tokens`, EOS and the stop ids cannot be
    sampled; each token the row has generated so far (its prompt does not count) loses `frequency_penalty` times its
    count plus `presence_penalty` (OpenAI's definition; negative values favour repeats)."""
    for i, s in enumerate(seqs):
        p = s.params
        if s.stop_ids and len(s.output) < p.min_new_tokens:
            logits[i, list(s.stop_ids)] = float("-inf")
        if s.output and (p.frequency_penalty or p.presence_penalty):
            ids, counts = torch.tensor(s.output).unique(return_counts=True)
            penalty = p.frequency_penalty * counts.to(logits.dtype) + p.presence_penalty
            logits[i, ids.to(logits.device)] -= penalty.to(logits.device)


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One index per row of `probs` [B, V] (rows need not sum to 1), drawn with probability proportional to its entry,
    given one uniform number in [0, 1) per row (`uniforms` [B], float64).

    The inverse CDF: a binary search for the row's uniform number in the row's cumulative sum. It is the
    distribution `torch.multinomial(probs, 1)` draws from, but on CPU that call draws an exponential variate for every
    entry (B x V of them: a sizeable share of a decode step at 32 x 49k entries) where this reads each entry once.
    The sum is in float64, so rounding moves no probability mass that matters (float32 would move ~1e-7 per entry).
    """
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)  # each entry widened, then summed: no float64 copy first
    total = cdf[:, -1:]
    if not bool(torch.isfinite(total).all()):  # else searchsorted answers an index past the vocabulary
        raise ValueError(NOT_FINITE)
    u = uniforms.to(torch.float64).view(-1, 1) * total
    # strictly below the total: `right=True` then finds the first entry whose cumulative sum exceeds u, which has
    # nonzero probability (a zeroed entry repeats the previous sum)
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True).flatten()


def top_k_top_p(probs: torch.Tensor, seqs: list[GenerationState]) -> torch.Tensor:
    """Zero the probabilities outside each row's top-k and top-p set (as SGLang's torch sampler)."""
    V = probs.shape[-1]
    top_k = torch.tensor([V if s.params.top_k == -1 else min(s.params.top_k, V) for s in seqs], device=probs.device)
    top_p = torch.tensor([s.params.top_p for s in seqs], device=probs.device)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(V, device=probs.device)[None, :]
    drop = (ranks >= top_k[:, None]) | ((sorted_p.cumsum(-1) - sorted_p) > top_p[:, None])
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter(1, order, sorted_p)


def finish_reason(s: GenerationState, tokenizer: Any, context_length: int) -> Optional[dict]:
    """SGLang's finish_reason for a row whose newest token was just appended, or None if it goes on."""
    sp = s.params
    if sp.stop:
        longest = max(len(x) for x in sp.stop)
        # A character can take several byte-level tokens; decode a tail long enough for the longest stop.
        tail = tokenizer.decode(s.output[-(4 * longest + 2) :])
        for stop in sp.stop:
            if stop in tail:
                return {"type": "stop", "matched": stop}
    if s.output[-1] in s.stop_ids:
        return {"type": "stop", "matched": s.output[-1]}
    if len(s.output) >= sp.max_new_tokens:
        return {"type": "length", "length": sp.max_new_tokens}
    if len(s.prompt) + len(s.output) >= context_length:
        return {"type": "length", "length": len(s.output)}
    return None


def sample_and_append(
    logits: torch.Tensor,
    states: list[GenerationState],
    tokenizer: Any,
    context_length: int,
    original_logprob: bool = False,
) -> tuple[torch.Tensor, list[Optional[dict]]]:
    """Sample one token per row, append it (and its logprob, where asked for) to the row. Returns the tokens [B] and
    each row's finish_reason (None: the row goes on); finishing the row is the caller's business."""
    tokens, logprobs = sample_tokens(logits, states, original_logprob=original_logprob)
    tok_list = tokens.tolist()
    lp_list = logprobs.tolist() if any(s.return_logprob for s in states) else None  # one device sync, not B
    reasons = []
    for i, s in enumerate(states):
        s.output.append(tok_list[i])
        if lp_list is not None and s.return_logprob:
            s.logprobs.append(lp_list[i])
        reasons.append(finish_reason(s, tokenizer, context_length))
    return tokens, reasons
