"""A small SGLang-compatible generation server: continuous batching with a KV cache, on CPU or one GPU.

    python -m areal_lite.serve --model-path PATH_OR_ALIAS [--host 127.0.0.1] [--port 30000] [--threads 1]

It speaks the subset of SGLang's native HTTP API that RL rollout needs (`/generate`, `/health`, `/model_info`,
`/pause_generation`, `/continue_generation`, `/abort_request`, `/update_weights_from_disk`, `/flush_cache`), with
SGLang 0.5.23's request and response shapes, so the same client code talks to either server.

Design decisions
- Two threads, one owner. The asyncio event loop (aiohttp) parses and validates requests and writes responses; it
  never touches the model. One *scheduler thread* owns the model, the KV cache and the sampling state. The two
  talk through a single ordered event queue (requests and control commands go in; results come back through
  `loop.call_soon_threadsafe`). Because the scheduler is the only writer of model state, pause, abort and weight
  updates need no locks: they are events handled *between* model steps. A thread (rather than `run_in_executor`
  per step) keeps the decode loop free of event-loop round trips; torch releases the GIL inside its kernels, so
  the HTTP side stays responsive while the model computes.
- Continuous batching. The scheduler keeps a *running batch*. Each loop iteration it (1) handles pending events,
  (2) admits waiting requests up to `--max-running-requests`, prefilling all newcomers together, (3) runs one
  decode step for the whole batch. Finished rows leave after the step in which they finish; new rows join between
  steps. A request never waits for a fixed batch to fill or to drain.
- Left-padded batch KV cache. All rows share one `transformers.DynamicCache` whose per-layer tensors are
  `[B, heads, T, head_dim]`. Rows of different lengths are *left*-padded so every row's newest token sits in the
  last column; an attention mask marks padding, and explicit `position_ids` give each row its own positions, so
  padding changes nothing numerically (greedy output is the same alone or batched). Joining = pad the running
  cache and the newcomers' cache to a common length and concatenate along the batch dimension (only when
  newcomers arrive). Leaving = `index_select` the surviving rows, then drop leading columns that are padding in
  every row. Prompts that are identical within one prefill (`n > 1`) are computed once and their cache rows copied.
- Logprobs follow SGLang 0.5.23 (python/sglang/srt/layers/sampler.py): `output_token_logprobs` is
  `log_softmax(logits / temperature)` at the sampled token: temperature applied, top-p/top-k truncation *not*
  applied; greedy requests (temperature < 1e-6) get `log_softmax(logits)`. `--return-original-logprob` (SGLang's
  `SGLANG_RETURN_ORIGINAL_LOGPROB=1`, also honoured) returns `log_softmax(logits)` always. Logit masks that change
  what can be sampled (EOS suppressed until `min_new_tokens`) are applied first, as SGLang's penalizers are.
- Pause (SGLang semantics, mode "abort"): requests in flight return at once with `finish_reason` abort and the
  tokens made so far; requests that arrive while paused are held and start after `/continue_generation`. Modes
  "in_place" and "retract" keep the running batch frozen (its KV cache kept) and resume it on continue.
- Weight updates from disk load a safetensors folder into the live model between steps. As in SGLang, the update
  is immediate while paused; otherwise it waits for running requests to finish (new ones are held meanwhile), or
  aborts them first when `abort_all_requests` is true. So a response comes from one weight version, reported as
  `meta_info.weight_version` (the given `weight_version`, or the current one plus 1 if none is given); the only
  exception, as in SGLang, is a batch frozen by an "in_place"/"retract" pause, which resumes under the new weights.
- Strict input checking. Bodies are validated against SGLang's JSON contract (unknown `sampling_params` keys and
  wrong types are rejected; `16.0` is not an integer; booleans are not numbers) before anything is queued. A bad
  request gets HTTP 400 `{"error": "..."}` and the server keeps serving; unknown routes get 404, wrong methods 405.
  SGLang parameters this server does not implement (penalties, grammars, ...) are accepted only at their neutral
  values and rejected otherwise, rather than silently ignored.
- No prefix cache: `cached_tokens` is always 0 and `/flush_cache` has nothing to drop.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import glob
import json
import logging
import math
import os
import queue
import signal
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

log = logging.getLogger("areal_lite.serve")

GREEDY_EPS = 1e-6  # SGLang: temperature below this means greedy
TOP_K_ALL = 1 << 30  # SGLang's "whole vocabulary"
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang 0.5.23 default
MAX_PROMPTS_PER_REQUEST = 1024
MAX_SAMPLES_PER_REQUEST = 4096
DEFAULT_WEIGHT_VERSION = "default"  # SGLang's initial weight_version

__all__ = ["BadRequest", "SamplingParams", "Sequence", "Engine", "RunningBatch", "build_app", "main"]


class BadRequest(ValueError):
    """A client error; the HTTP layer answers 400 {"error": str(e)}."""


# ==============================================================================================================
# Request parsing and validation (event-loop side; pure functions, easy to test)
# ==============================================================================================================

# Every key SGLang 0.5.23 accepts in `sampling_params` (python/sglang/api/v1/api_types.py, _FIELDS_SamplingParams).
SGLANG_SAMPLING_KEYS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
)  # fmt: skip
# Keys we accept but do not implement: only their neutral value is allowed (None is always allowed).
NEUTRAL_SAMPLING_VALUES: dict[str, Any] = {
    "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
    "stop_regex": [], "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None,
    "logit_bias": {}, "sampling_seed": None, "custom_params": None, "beam_width": 1, "watermark": None,
    "choice": [],
}  # fmt: skip
# Keys with no effect on this server's outputs (accepted with any well-typed value).
IGNORED_SAMPLING_KEYS = ("spaces_between_special_tokens", "stream_interval")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _describe(v: Any) -> str:
    text = json.dumps(v) if isinstance(v, (str, int, float, bool, type(None))) else type(v).__name__
    return f"{type(v).__name__} {text}" if len(text) < 60 else type(v).__name__


def _want_int(where: str, v: Any) -> int:
    if not _is_int(v):
        raise BadRequest(f"{where}: expected an integer, got {_describe(v)}")
    return v


def _want_float(where: str, v: Any) -> float:
    if not _is_number(v):
        raise BadRequest(f"{where}: expected a number, got {_describe(v)}")
    if not math.isfinite(v):
        raise BadRequest(f"{where}: must be finite, got {v}")
    return float(v)


def _want_bool(where: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise BadRequest(f"{where}: expected true or false, got {_describe(v)}")
    return v


@dataclass
class SamplingParams:
    """The sampling parameters this server implements, after validation."""

    max_new_tokens: Optional[int] = None  # None: 128, or what still fits in the context (resolved per prompt)
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


def parse_sampling_params(raw: Any, vocab_size: int, where: str = "sampling_params") -> SamplingParams:
    """Validate one SGLang `sampling_params` object (strict types, SGLang's range checks)."""
    if raw is None:
        return SamplingParams()
    if not isinstance(raw, dict):
        raise BadRequest(f"{where}: expected an object, got {_describe(raw)}")
    sp = SamplingParams()
    for key, v in raw.items():
        w = f"{where}.{key}"
        if key not in SGLANG_SAMPLING_KEYS:
            raise BadRequest(f"{where}: unknown field `{key}`, expected one of {', '.join(SGLANG_SAMPLING_KEYS)}")
        if v is None:
            continue  # SGLang: null means "default"
        if key == "max_new_tokens":
            sp.max_new_tokens = _want_int(w, v)
        elif key == "min_new_tokens":
            sp.min_new_tokens = _want_int(w, v)
        elif key == "temperature":
            sp.temperature = _want_float(w, v)
        elif key == "top_p":
            sp.top_p = _want_float(w, v)
        elif key == "top_k":
            sp.top_k = _want_int(w, v)
        elif key == "n":
            sp.n = _want_int(w, v)
        elif key in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
            setattr(sp, key, _want_bool(w, v))
        elif key == "stop":
            stops = [v] if isinstance(v, str) else v
            if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
                raise BadRequest(f"{w}: expected a string or a list of strings, got {_describe(v)}")
            sp.stop = [s for s in stops if s]  # an empty stop string would match everywhere; SGLang skips it
        elif key == "stop_token_ids":
            if not isinstance(v, list) or not all(_is_int(t) for t in v):
                raise BadRequest(f"{w}: expected a list of integers, got {_describe(v)}")
            bad = [t for t in v if not 0 <= t < vocab_size]
            if bad:
                raise BadRequest(f"{w}: token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
            sp.stop_token_ids = list(v)
        elif key in IGNORED_SAMPLING_KEYS:
            if key == "spaces_between_special_tokens":
                _want_bool(w, v)
            else:
                _want_int(w, v)
        else:  # accepted by SGLang, not implemented here: only the neutral value passes
            neutral = NEUTRAL_SAMPLING_VALUES[key]
            if v != neutral:
                raise BadRequest(
                    f"{w}: not supported by the embedded server (only {json.dumps(neutral)} or null is accepted)"
                )
    # Range checks, worded like SGLang's SamplingParams.verify.
    if sp.temperature < 0:
        raise BadRequest(f"{where}: temperature must be a non-negative finite number, got {sp.temperature}.")
    if not 0.0 < sp.top_p <= 1.0:
        raise BadRequest(f"{where}: top_p must be in (0, 1], got {sp.top_p}.")
    if sp.top_k != -1 and sp.top_k < 1:
        raise BadRequest(f"{where}: top_k must be -1 (disable) or at least 1, got {sp.top_k}.")
    if sp.max_new_tokens is not None and sp.max_new_tokens < 0:
        raise BadRequest(f"{where}: max_new_tokens must be at least 0, got {sp.max_new_tokens}.")
    limit = DEFAULT_MAX_NEW_TOKENS if sp.max_new_tokens is None else sp.max_new_tokens
    if not 0 <= sp.min_new_tokens <= limit:
        raise BadRequest(f"{where}: min_new_tokens must be in [0, max_new_tokens({limit})], got {sp.min_new_tokens}.")
    if sp.n < 1:
        raise BadRequest(f"{where}: n must be at least 1, got {sp.n}.")
    if sp.top_k >= TOP_K_ALL:
        sp.top_k = -1
    return sp


@dataclass
class PromptSpec:
    """One prompt of a /generate call, validated."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool


def _per_prompt(name: str, value: Any, count: int, check: Callable[[str, Any], Any], default: Any) -> list[Any]:
    """SGLang's "one value or one per prompt" fields."""
    if value is None:
        return [default] * count
    if isinstance(value, list):
        if len(value) != count:
            raise BadRequest(f"{name}: got {len(value)} values for {count} prompts")
        return [check(f"{name}[{i}]", v) for i, v in enumerate(value)]
    return [check(name, value)] * count


def parse_generate_body(
    body: Any,
    *,
    vocab_size: int,
    context_length: int,
    tokenize: Optional[Callable[[str], list[int]]],
) -> tuple[bool, list[PromptSpec], bool]:
    """Validate a /generate body. Returns (is_batch, prompts, return_text_in_logprobs); raises BadRequest."""
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {_describe(body)}")
    has_text = body.get("text") is not None
    has_ids = body.get("input_ids") is not None
    if body.get("input_embeds") is not None:
        raise BadRequest("input_embeds is not supported by the embedded server; send input_ids or text")
    if has_text == has_ids:
        raise BadRequest("give exactly one of `text` or `input_ids`")
    if body.get("stream") not in (None, False):
        raise BadRequest("stream: streaming is not supported by the embedded server; send stream=false")
    for key, neutral in (("logprob_start_len", -1), ("top_logprobs_num", 0)):
        v = body.get(key)
        if v is None:
            continue
        values = v if isinstance(v, list) else [v]
        for x in values:
            _want_int(key, x)
        if any(x != neutral for x in values):
            raise BadRequest(f"{key}: not supported by the embedded server (only {neutral} is accepted)")
    if body.get("token_ids_logprob") not in (None, []):
        raise BadRequest("token_ids_logprob: not supported by the embedded server")
    text_in_lp = body.get("return_text_in_logprobs")
    text_in_lp = False if text_in_lp is None else _want_bool("return_text_in_logprobs", text_in_lp)

    # --- prompts -> token ids
    if has_text:
        text = body["text"]
        is_batch = isinstance(text, list)
        texts = text if is_batch else [text]
        if not all(isinstance(t, str) for t in texts):
            raise BadRequest("text: expected a string or a list of strings")
        if tokenize is None:
            raise BadRequest("text: this server has no tokenizer; send input_ids")
        prompts = [tokenize(t) for t in texts]
    else:
        ids = body["input_ids"]
        if not isinstance(ids, list):
            raise BadRequest(f"input_ids: expected a list of token ids or a list of lists, got {_describe(ids)}")
        is_batch = len(ids) > 0 and all(isinstance(x, list) for x in ids)
        prompts = ids if is_batch else [ids]
        for i, p in enumerate(prompts):
            where = f"input_ids[{i}]" if is_batch else "input_ids"
            if not isinstance(p, list) or not all(_is_int(t) for t in p):
                raise BadRequest(f"{where}: expected a list of integer token ids")
            bad = [t for t in p if not 0 <= t < vocab_size]
            if bad:
                raise BadRequest(f"{where}: token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
    if is_batch and not prompts:
        raise BadRequest("empty batch: give at least one prompt")
    if len(prompts) > MAX_PROMPTS_PER_REQUEST:
        raise BadRequest(f"too many prompts in one request: {len(prompts)} > {MAX_PROMPTS_PER_REQUEST}")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise BadRequest(f"prompt {i} is empty (0 tokens)")
    count = len(prompts)

    # --- sampling params: one dict, or one per prompt
    raw_sp = body.get("sampling_params")
    if isinstance(raw_sp, list):
        if not is_batch:
            raise BadRequest("sampling_params: a list is only allowed with a batch of prompts")
        if len(raw_sp) != count:
            raise BadRequest(f"sampling_params: got {len(raw_sp)} entries for {count} prompts")
        params = [parse_sampling_params(s, vocab_size, f"sampling_params[{i}]") for i, s in enumerate(raw_sp)]
    else:
        one = parse_sampling_params(raw_sp, vocab_size)
        params = [one] * count
    params = list(params)
    if len({sp.n for sp in params}) > 1:
        raise BadRequest("sampling_params: n must be the same for all prompts (SGLang's rule)")
    if sum(sp.n for sp in params) > MAX_SAMPLES_PER_REQUEST:
        raise BadRequest(f"too many samples in one request (> {MAX_SAMPLES_PER_REQUEST})")
    for i, (p, sp) in enumerate(zip(prompts, params)):
        if len(p) >= context_length:
            raise BadRequest(f"prompt {i}: {len(p)} tokens, longer than the context length {context_length}")
        if sp.max_new_tokens is None:
            # As SGLang: an unset max_new_tokens is 128, shortened to what still fits; a set one must fit.
            params[i] = sp = dataclasses.replace(
                sp, max_new_tokens=min(DEFAULT_MAX_NEW_TOKENS, context_length - len(p))
            )
        elif len(p) + sp.max_new_tokens > context_length:
            raise BadRequest(
                f"prompt {i}: {len(p)} prompt tokens + max_new_tokens {sp.max_new_tokens} exceeds the context "
                f"length {context_length}"
            )

    # --- rid: string (suffixed per prompt in a batch, as SGLang does) or one string per prompt
    rid = body.get("rid")
    if rid is None:
        rids = [uuid.uuid4().hex for _ in range(count)]
    elif isinstance(rid, str):
        if not rid:
            raise BadRequest("rid: must not be empty")
        rids = [f"{rid}_{i}" for i in range(count)] if is_batch else [rid]
    elif isinstance(rid, list):
        if not is_batch:
            raise BadRequest("rid: a list is only allowed with a batch of prompts")
        if len(rid) != count or not all(isinstance(r, str) and r for r in rid):
            raise BadRequest(f"rid: expected {count} non-empty strings, one per prompt")
        rids = list(rid)
    else:
        raise BadRequest(f"rid: expected a string or a list of strings, got {_describe(rid)}")
    if len(set(rids)) != len(rids):
        raise BadRequest("rid: duplicate request ids in one batch")

    logprob = _per_prompt("return_logprob", body.get("return_logprob"), count, _want_bool, False)
    specs = [PromptSpec(r, list(p), sp, lp) for r, p, sp, lp in zip(rids, prompts, params, logprob)]
    return is_batch, specs, text_in_lp


# ==============================================================================================================
# Sequences and the running batch (scheduler side)
# ==============================================================================================================


@dataclass(eq=False)
class Sequence:
    """One row of generation: a prompt plus the tokens sampled for it so far."""

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
    on_done: Optional[Callable[["Sequence"], None]] = None


def _left_pad(t: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """Pad `t` with zeros at the front of `dim` up to `length`."""
    missing = length - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


class RunningBatch:
    """B sequences decoding together over one left-padded KV cache.

    Invariants: every per-layer key/value tensor is [B, heads, T, head_dim]; `mask` is [B, T] (False = padding);
    `next_ids[b]` is row b's newest token, sampled but not yet fed to the model; `pos[b]` is its position
    (= number of real tokens before it).
    """

    def __init__(self) -> None:
        self.seqs: list[Sequence] = []
        self.cache: Any = None
        self.mask: Optional[torch.Tensor] = None
        self.next_ids: Optional[torch.Tensor] = None
        self.pos: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return len(self.seqs)

    def add(self, seqs: list[Sequence], cache: Any, mask: torch.Tensor, next_ids: torch.Tensor, pos: torch.Tensor):
        """Join newcomers (with their own prefilled cache) into the batch: pad both to a common length, concat."""
        if not self.seqs:
            self.seqs, self.cache, self.mask, self.next_ids, self.pos = list(seqs), cache, mask, next_ids, pos
            return
        length = max(self.mask.shape[1], mask.shape[1])
        for mine, theirs in zip(self.cache.layers, cache.layers):
            mine.keys = torch.cat([_left_pad(mine.keys, length, 2), _left_pad(theirs.keys, length, 2)], dim=0)
            mine.values = torch.cat([_left_pad(mine.values, length, 2), _left_pad(theirs.values, length, 2)], dim=0)
        self.mask = torch.cat([_left_pad(self.mask, length, 1), _left_pad(mask, length, 1)], dim=0)
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


# ==============================================================================================================
# The scheduler
# ==============================================================================================================


class Engine:
    """Owns the model; runs the continuous-batching loop in one thread. Thread-safe entry points: `submit`,
    `command`, `stats`, `stop`. Everything else runs on the scheduler thread."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        model_path: str,
        max_running_requests: int = 32,
        max_prefill_tokens: int = 8192,
        context_length: int = 4096,
        random_seed: int = 1,
        threads: int = 1,
        return_original_logprob: bool = False,
        decode_log_interval: int = 40,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.device = next(model.parameters()).device
        self.max_running = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.context_length = context_length
        self.threads = threads
        self.return_original_logprob = return_original_logprob
        self.decode_log_interval = decode_log_interval
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self.eos_ids = frozenset(_eos_ids(model, tokenizer))
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(random_seed)
        self.weight_version = DEFAULT_WEIGHT_VERSION

        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        # Scheduler-thread state.
        self.batch = RunningBatch()
        self.waiting: list[Sequence] = []  # admitted to the server, not yet prefilled
        self.held: list[Sequence] = []  # arrived while paused; start on continue
        self.paused = False
        self.pending_update: Optional[tuple[dict, concurrent.futures.Future]] = None
        self._stopping = False
        # Counters, read by /server_info (plain ints: reads from another thread are fine).
        self.counters = dict(
            max_running_batch=0, decode_steps=0, prefill_batches=0, prompt_tokens=0, generated_tokens=0,
            finished_requests=0, aborted_requests=0, weight_updates=0,
        )  # fmt: skip
        self._log_t0 = time.perf_counter()
        self._log_tokens = 0

    # ---- thread-safe API --------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="areal-lite-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._events.put(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout=10)

    def submit(self, seqs: list[Sequence]) -> None:
        self._events.put(("submit", seqs))

    def command(self, name: str, **kwargs: Any) -> concurrent.futures.Future:
        """Queue a control command; the future resolves once the scheduler has handled it."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._events.put((name, (kwargs, fut)))
        return fut

    def new_sequence(self, spec: PromptSpec, sample: int) -> Sequence:
        sp = spec.params
        stop_ids = frozenset() if sp.ignore_eos else self.eos_ids | frozenset(sp.stop_token_ids)
        rid = spec.rid if sp.n == 1 else f"{spec.rid}_{sample}"
        return Sequence(rid, spec.rid, spec.input_ids, sp, spec.return_logprob, stop_ids)

    def stats(self) -> dict:
        return dict(
            self.counters,
            num_running=len(self.batch),
            num_waiting=len(self.waiting),
            num_held=len(self.held),
            paused=self.paused,
            weight_version=self.weight_version,
        )

    # ---- the loop ---------------------------------------------------------------------------------------------

    def _run(self) -> None:
        # torch's intra-op thread count is per calling thread for OpenMP: set it here, on the thread that computes.
        torch.set_num_threads(self.threads)
        while not self._stopping:
            try:
                self._iteration()
            except Exception as e:  # a bug or OOM must not kill the server: fail the batch, keep serving
                log.error("scheduler error: %s\n%s", e, traceback.format_exc())
                self._abort(lambda s: True, f"internal server error: {type(e).__name__}: {e}", include_held=False)
        self._abort(lambda s: True, "server shutting down", include_held=True)

    def _can_admit(self) -> bool:
        return bool(self.waiting) and not self.paused and self.pending_update is None

    def _iteration(self) -> None:
        self._maybe_apply_update()  # the running batch may have just drained
        busy = (len(self.batch) > 0 and not self.paused) or self._can_admit()
        self._handle_events(block=not busy)
        if self._stopping:
            return
        self._maybe_apply_update()
        if self._can_admit() and len(self.batch) < self.max_running:
            take = self.max_running - len(self.batch)
            newcomers, self.waiting = self.waiting[:take], self.waiting[take:]
            self._prefill(newcomers)
        if len(self.batch) > 0 and not self.paused:
            self._decode_step()

    def _handle_events(self, block: bool) -> None:
        events = []
        if block:
            events.append(self._events.get())
        while True:
            try:
                events.append(self._events.get_nowait())
            except queue.Empty:
                break
        for name, payload in events:
            if name == "stop":
                self._stopping = True
                return
            if name == "submit":
                (self.held if self.paused else self.waiting).extend(payload)
                continue
            kwargs, fut = payload
            try:
                result = getattr(self, f"_cmd_{name}")(fut=fut, **kwargs)
            except Exception as e:  # a failed command answers its caller and leaves the server running
                log.error("command %s failed: %s\n%s", name, e, traceback.format_exc())
                if not fut.done():
                    fut.set_exception(e)
                continue
            if result is not _DEFERRED and not fut.done():
                fut.set_result(result)

    # ---- commands (scheduler thread) --------------------------------------------------------------------------

    def _cmd_abort(self, fut, rid: str = "", abort_all: bool = False):
        if abort_all:
            n = self._abort(lambda s: True, "Aborted by abort_request (abort_all).", include_held=True)
        else:
            n = self._abort(lambda s: s.rid == rid or s.parent == rid, "Aborted by abort_request.", include_held=True)
        return n

    def _cmd_pause(self, fut, mode: str = "abort"):
        self.paused = True
        if mode == "abort":
            # In-flight requests (running or queued) return now with what they have; later arrivals are held.
            self._abort(lambda s: True, "Aborted by pause_generation.", include_held=False)
        return {"message": "Generation paused successfully.", "status": "ok"}

    def _cmd_continue(self, fut):
        self.paused = False
        self.waiting.extend(self.held)
        self.held = []
        return {"message": "Generation continued successfully.", "status": "ok"}

    def _cmd_flush_cache(self, fut):
        busy = len(self.batch) + len(self.waiting)
        return busy == 0

    def _cmd_update_weights(self, fut, **req):
        if req.get("abort_all_requests"):
            self._abort(lambda s: True, "Aborted by update_weights_from_disk.", include_held=False)
        if self.pending_update is not None:
            return {"success": False, "message": "another weight update is in progress", "num_paused_requests": 0}
        # As SGLang: immediate while paused; otherwise wait for the running batch to drain (admission stops).
        self.pending_update = (req, fut)
        self._maybe_apply_update()
        return _DEFERRED

    def _maybe_apply_update(self) -> None:
        if self.pending_update is None or (len(self.batch) > 0 and not self.paused):
            return
        req, fut = self.pending_update
        self.pending_update = None
        try:
            result = self._load_weights(req)
        except Exception as e:  # the model is unchanged when loading fails (see _load_weights)
            result = {"success": False, "message": f"Failed to update weights: {e}", "num_paused_requests": 0}
        fut.set_result(result)

    @torch.no_grad()
    def _load_weights(self, req: dict) -> dict:
        from safetensors.torch import load_file

        path = req["model_path"]
        t0 = time.perf_counter()
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{path} is not a directory")
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {path}")
        incoming: dict[str, torch.Tensor] = {}
        for f in files:
            incoming.update(load_file(f))
        params = self.model.state_dict()
        # Check everything before changing anything, so a bad folder leaves the live model untouched.
        unknown = sorted(set(incoming) - set(params))
        if unknown:
            raise ValueError(f"unexpected tensors {unknown[:5]}")
        for name, t in incoming.items():
            if tuple(t.shape) != tuple(params[name].shape):
                raise ValueError(f"{name}: shape {tuple(t.shape)} != model's {tuple(params[name].shape)}")
        loaded_ptrs = {params[n].data_ptr() for n in incoming}
        missing = [n for n, p in params.items() if n not in incoming and p.data_ptr() not in loaded_ptrs]
        if missing:  # tied weights (lm_head = embed_tokens) are saved once; anything else missing is an error
            raise ValueError(f"missing tensors {missing[:5]}")
        for name, t in incoming.items():
            params[name].copy_(t.to(params[name].device))
        old = self.weight_version
        version = req.get("weight_version")
        if version is None:  # not given: count up ("default" -> "1" -> "2" ...)
            version = str(int(old) + 1) if old.lstrip("-").isdigit() else "1"
        self.weight_version = version
        self.model_path = path
        self.counters["weight_updates"] += 1
        dt = time.perf_counter() - t0
        log.info("weights updated from %s in %.2fs (version %s -> %s)", path, dt, old, version)
        return {
            "success": True,
            "message": f"Succeeded to update model weights. Weight version updated to {version}.",
            "num_paused_requests": 0,
        }

    def _abort(self, match: Callable[[Sequence], bool], message: str, include_held: bool) -> int:
        """Finish every matching sequence now with finish_reason abort (tokens made so far are kept)."""
        reason = {"type": "abort", "message": message, "status_code": None, "err_type": None}
        count = 0
        pools = [self.waiting] + ([self.held] if include_held else [])
        for pool in pools:
            for s in [s for s in pool if match(s)]:
                pool.remove(s)
                self._finish(s, reason)
                count += 1
        keep = []
        for i, s in enumerate(self.batch.seqs):
            if match(s):
                self._finish(s, reason)
                count += 1
            else:
                keep.append(i)
        with torch.inference_mode():
            self.batch.keep(keep)
        return count

    def _finish(self, seq: Sequence, reason: dict) -> None:
        seq.finish = reason
        seq.finished_at = time.perf_counter()
        seq.weight_version = self.weight_version
        key = "aborted_requests" if reason["type"] == "abort" else "finished_requests"
        self.counters[key] += 1
        if seq.on_done is not None:
            seq.on_done(seq)

    # ---- model steps ------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def _prefill(self, newcomers: list[Sequence]) -> None:
        """Run the prompts of the newcomers (in groups bounded by max_prefill_tokens), then join the batch."""
        ready = []
        for s in newcomers:  # max_new_tokens == 0: nothing to compute
            if s.params.max_new_tokens == 0:
                self._finish(s, {"type": "length", "length": 0})
            else:
                ready.append(s)
        groups: list[list[Sequence]] = [[]]
        for s in ready:
            longest = max([len(s.prompt)] + [len(g.prompt) for g in groups[-1]])
            if groups[-1] and longest * (len(groups[-1]) + 1) > self.max_prefill_tokens:
                groups.append([])
            groups[-1].append(s)
        try:
            for group in groups:
                if group:
                    self._prefill_group(group)
        except Exception as e:
            # Newcomers are in neither `waiting` nor the batch now: answer them here, or their clients would hang.
            reason = {"type": "abort", "message": f"prefill failed: {type(e).__name__}: {e}", "status_code": 500,
                      "err_type": "InternalServerError"}  # fmt: skip
            for s in ready:
                if s.finish is None and s not in self.batch.seqs:
                    self._finish(s, reason)
            raise

    def _prefill_group(self, seqs: list[Sequence]) -> None:
        from transformers import DynamicCache

        # Identical prompts (n > 1 samples) are computed once; their rows are copied afterwards.
        unique: dict[tuple, int] = {}
        row_of = [unique.setdefault(tuple(s.prompt), len(unique)) for s in seqs]
        prompts = [list(p) for p in unique]
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
            input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True,
            logits_to_keep=1,
        )  # fmt: skip
        self.counters["prefill_batches"] += 1
        self.counters["prompt_tokens"] += sum(len(p) for p in prompts)
        if len(unique) != len(seqs) or row_of != list(range(len(seqs))):
            expand = torch.tensor(row_of, device=self.device)
            for layer in cache.layers:
                layer.keys = layer.keys.index_select(0, expand)
                layer.values = layer.values.index_select(0, expand)
            mask = mask.index_select(0, expand)
            logits = out.logits[:, -1].index_select(0, expand)
        else:
            logits = out.logits[:, -1]
        tokens = self._sample_and_record(logits, seqs)
        survivors = [i for i, s in enumerate(seqs) if s.finish is None]
        if not survivors:
            return
        idx = torch.tensor(survivors, device=self.device)
        for layer in cache.layers:
            layer.keys = layer.keys.index_select(0, idx)
            layer.values = layer.values.index_select(0, idx)
        plen = torch.tensor([len(seqs[i].prompt) for i in survivors], device=self.device)
        self.batch.add([seqs[i] for i in survivors], cache, mask.index_select(0, idx), tokens[idx], plen)
        self.counters["max_running_batch"] = max(self.counters["max_running_batch"], len(self.batch))

    @torch.inference_mode()
    def _decode_step(self) -> None:
        b = self.batch
        mask = torch.cat([b.mask, b.mask.new_ones(len(b), 1)], dim=1)
        out = self.model(
            input_ids=b.next_ids[:, None], attention_mask=mask, position_ids=b.pos[:, None],
            past_key_values=b.cache, use_cache=True,
        )  # fmt: skip
        b.mask, b.pos = mask, b.pos + 1
        self.counters["decode_steps"] += 1
        self.counters["max_running_batch"] = max(self.counters["max_running_batch"], len(b))
        b.next_ids = self._sample_and_record(out.logits[:, -1], b.seqs)
        keep = [i for i, s in enumerate(b.seqs) if s.finish is None]
        b.keep(keep)
        self._log_progress(len(keep))

    def _log_progress(self, running: int) -> None:
        steps = self.counters["decode_steps"]
        now = time.perf_counter()
        # Every N steps, but at most every 2 s: a tiny model makes hundreds of steps per second.
        if self.decode_log_interval > 0 and steps % self.decode_log_interval == 0 and now - self._log_t0 >= 2.0:
            total = self.counters["generated_tokens"]
            rate = (total - self._log_tokens) / max(now - self._log_t0, 1e-9)
            self._log_t0, self._log_tokens = now, total
            log.info(
                "decode batch: #running %d, #waiting %d, #held %d, gen throughput %.1f token/s",
                running, len(self.waiting), len(self.held), rate,
            )  # fmt: skip

    def _sample_and_record(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Sample one token per row, append it (and its logprob), and finish rows that are done."""
        tokens, logprobs = sample_tokens(
            logits.float(), seqs, self.generator, original_logprob=self.return_original_logprob
        )
        tok_list = tokens.tolist()
        lp_list = logprobs.tolist() if any(s.return_logprob for s in seqs) else None
        for i, s in enumerate(seqs):
            s.output.append(tok_list[i])
            if lp_list is not None and s.return_logprob:
                s.logprobs.append(lp_list[i])
            reason = self._finish_reason(s)
            if reason is not None:
                self._finish(s, reason)
        self.counters["generated_tokens"] += len(seqs)
        return tokens

    def _finish_reason(self, s: Sequence) -> Optional[dict]:
        """SGLang's order: stop string, then stop token / EOS, then length."""
        sp = s.params
        if sp.stop:
            longest = max(len(x) for x in sp.stop)
            # A character can take several byte-level tokens; decode a tail long enough for the longest stop.
            tail = self.tokenizer.decode(s.output[-(4 * longest + 2) :])
            for stop in sp.stop:
                if stop in tail:
                    return {"type": "stop", "matched": stop}
        if s.output[-1] in s.stop_ids:
            return {"type": "stop", "matched": s.output[-1]}
        if len(s.output) >= sp.max_new_tokens:
            return {"type": "length", "length": sp.max_new_tokens}
        if len(s.prompt) + len(s.output) >= self.context_length:
            return {"type": "length", "length": len(s.output)}
        return None


_DEFERRED = object()  # a command whose future is resolved later by the scheduler


def sample_tokens(
    logits: torch.Tensor, seqs: list[Sequence], generator: torch.Generator, original_logprob: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of `logits` [B, V] (float32) and its logprob, with each row's own sampling parameters."""
    B = logits.shape[0]
    # min_new_tokens: EOS and stop ids cannot be sampled yet (like SGLang's penalizer, before logprobs).
    for i, s in enumerate(seqs):
        if s.stop_ids and len(s.output) < s.params.min_new_tokens:
            logits[i, list(s.stop_ids)] = float("-inf")
    greedy = torch.tensor([s.params.greedy for s in seqs], device=logits.device)
    temps = torch.tensor([1.0 if s.params.greedy else s.params.temperature for s in seqs], device=logits.device)
    scaled = logits / temps[:, None]
    logprobs_all = torch.log_softmax(logits if original_logprob else scaled, dim=-1)
    tokens = torch.argmax(logits, dim=-1)
    if not bool(greedy.all()):
        rows = (~greedy).nonzero().flatten()
        probs = torch.softmax(scaled.index_select(0, rows), dim=-1)
        sub = [seqs[i] for i in rows.tolist()]
        if any(s.params.top_k != -1 or s.params.top_p < 1.0 for s in sub):
            probs = _top_k_top_p(probs, sub)
        picked = torch.multinomial(probs, 1, generator=generator).flatten()
        tokens = tokens.index_put((rows,), picked)
    logprobs = logprobs_all.gather(1, tokens[:, None]).flatten()
    # JSON has no -inf; SGLang clamps the same way.
    logprobs = logprobs.clamp(min=torch.finfo(logprobs.dtype).min)
    assert tokens.shape == (B,)
    return tokens, logprobs


def _top_k_top_p(probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Zero the probabilities outside each row's top-k and top-p set (as SGLang's torch sampler)."""
    V = probs.shape[-1]
    top_k = torch.tensor([V if s.params.top_k == -1 else min(s.params.top_k, V) for s in seqs], device=probs.device)
    top_p = torch.tensor([s.params.top_p for s in seqs], device=probs.device)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(V, device=probs.device)[None, :]
    drop = (ranks >= top_k[:, None]) | ((sorted_p.cumsum(-1) - sorted_p) > top_p[:, None])
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter(1, order, sorted_p)


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """EOS ids from the generation config, the model config and the tokenizer (ChatML: <|im_end|>)."""
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


# ==============================================================================================================
# HTTP layer (event-loop side)
# ==============================================================================================================


class ServerState:
    """What the HTTP handlers share: the engine once loaded, and the rids in flight."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.engine: Optional[Engine] = None
        self.tokenizer: Any = None
        self.model_path = args.model_path
        self.inflight: set[str] = set()
        self.load_error: Optional[str] = None


def _json_error(status: int, error: str, **extra: Any):
    from aiohttp import web

    return web.json_response({"error": error, **extra}, status=status)


async def _read_json(request) -> Any:
    raw = await request.read()
    try:
        return json.loads(raw.decode("utf-8")) if raw.strip() else None
    except (UnicodeDecodeError, ValueError) as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None


async def _read_control_body(request) -> dict:
    body = await _read_json(request)
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {_describe(body)}")
    return body


def _response_for(seq: Sequence, tokenizer: Any, text_in_logprobs: bool) -> dict:
    """The SGLang /generate response object of one finished sequence."""
    sp = seq.params
    ids = seq.output
    matched = (seq.finish or {}).get("matched")
    text_ids = ids[:-1] if (isinstance(matched, int) and not sp.no_stop_trim and ids) else ids
    text = tokenizer.decode(text_ids, skip_special_tokens=sp.skip_special_tokens) if tokenizer is not None else ""
    if isinstance(matched, str) and not sp.no_stop_trim:
        cut = text.find(matched)
        if cut != -1:
            text = text[:cut]
    meta: dict[str, Any] = {
        "id": seq.rid,
        "finish_reason": seq.finish,
        "prompt_tokens": len(seq.prompt),
        "completion_tokens": len(ids),
        "cached_tokens": 0,
        "weight_version": seq.weight_version,
        "e2e_latency": round(seq.finished_at - seq.arrival, 6),
    }
    if seq.return_logprob:
        meta["output_token_logprobs"] = [
            [lp, tok, tokenizer.decode([tok]) if text_in_logprobs else None] for lp, tok in zip(seq.logprobs, ids)
        ]
    return {"text": text, "output_ids": list(ids), "meta_info": meta}


def build_app(state: ServerState):
    """The aiohttp application: routes, JSON errors for 400/404/405, and the generate handler."""
    from aiohttp import web

    @web.middleware
    async def errors(request, handler):
        try:
            return await handler(request)
        except BadRequest as e:
            return _json_error(400, str(e))
        except web.HTTPException as e:  # 404 unknown route, 405 wrong method, 413 body too large
            if e.status < 400:
                raise
            return _json_error(e.status, f"{e.reason}: {request.method} {request.path}")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug: say so, keep serving
            log.error("unhandled error on %s: %s\n%s", request.path, e, traceback.format_exc())
            return _json_error(500, f"internal server error: {type(e).__name__}: {e}")

    def engine_or_503() -> Engine:
        if state.engine is None:
            raise web.HTTPServiceUnavailable(text="model is loading")
        return state.engine

    async def health(request):
        return web.Response(status=200 if state.engine is not None else 503)

    async def health_generate(request):
        engine = state.engine
        if engine is None:
            return web.Response(status=503)
        if len(engine.batch) or engine.paused:  # busy (or gated): the scheduler is alive, skip the probe
            return web.Response(status=200)
        spec = PromptSpec(
            f"HEALTH_CHECK_{uuid.uuid4().hex}", [0], SamplingParams(max_new_tokens=1, temperature=0), False
        )
        try:
            await asyncio.wait_for(_run_sequences(state, [engine.new_sequence(spec, 0)]), timeout=30)
        except asyncio.TimeoutError:
            return web.Response(status=503)
        return web.Response(status=200)

    async def model_info(request):
        engine = state.engine
        cfg = engine.model.config if engine else None
        return web.json_response(
            {
                "model_path": engine.model_path if engine else state.model_path,
                "served_model_name": state.model_path,
                "tokenizer_path": state.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": engine.weight_version if engine else DEFAULT_WEIGHT_VERSION,
                "max_context_length": engine.context_length if engine else None,
                "vocab_size": engine.vocab_size if engine else None,
                "model_type": getattr(cfg, "model_type", None),
                "architectures": getattr(cfg, "architectures", None),
            }
        )

    async def server_info(request):
        engine = engine_or_503()
        args = {k: v for k, v in vars(state.args).items()}
        return web.json_response({"server": "areal-lite-embedded", "args": args, **engine.stats()})

    async def generate(request):
        engine = engine_or_503()
        body = await _read_json(request)
        tok = state.tokenizer
        is_batch, specs, text_in_lp = parse_generate_body(
            body,
            vocab_size=engine.vocab_size,
            context_length=engine.context_length,
            tokenize=(lambda t: tok(t)["input_ids"]) if tok is not None else None,
        )
        seqs = [engine.new_sequence(spec, j) for spec in specs for j in range(spec.params.n)]
        clash = [s.rid for s in seqs if s.rid in state.inflight]
        if clash:
            raise BadRequest(f"rid {clash[0]!r} is already in flight; request ids must be unique")
        await _run_sequences(state, seqs)
        out = [_response_for(s, tok, text_in_lp) for s in seqs]
        return web.json_response(out if (is_batch or len(out) > 1) else out[0])

    async def command(name: str, **kwargs: Any) -> Any:
        engine = engine_or_503()
        return await asyncio.wrap_future(engine.command(name, **kwargs))

    async def pause_generation(request):
        body = await _read_control_body(request)
        mode = body.get("mode", "abort") or "abort"
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest(f"mode: expected 'abort', 'retract' or 'in_place', got {_describe(mode)}")
        return web.json_response(await command("pause", mode=mode))

    async def continue_generation(request):
        await _read_control_body(request)
        return web.json_response(await command("continue"))

    async def abort_request(request):
        body = await _read_control_body(request)
        rid = body.get("rid", "")
        rid = "" if rid is None else rid
        if not isinstance(rid, str):
            raise BadRequest(f"rid: expected a string, got {_describe(rid)}")
        abort_all = body.get("abort_all", False)
        abort_all = False if abort_all is None else _want_bool("abort_all", abort_all)
        await command("abort", rid=rid, abort_all=abort_all)
        return web.Response(status=200)

    async def flush_cache(request):
        if request.method == "POST":
            await _read_control_body(request)
        if await command("flush_cache"):
            return web.Response(text="Cache flushed.\n", content_type="text/plain")
        return web.Response(
            status=400, content_type="text/plain",
            text="Cache not flushed: there are running or waiting requests (this server has no prefix cache).\n",
        )  # fmt: skip

    async def update_weights_from_disk(request):
        body = await _read_control_body(request)
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise BadRequest("model_path: expected a non-empty string")
        version = body.get("weight_version")
        if version is not None and not isinstance(version, str):
            raise BadRequest(f"weight_version: expected a string or null, got {_describe(version)}")
        for key in ("abort_all_requests", "flush_cache"):
            if body.get(key) is not None:
                _want_bool(key, body[key])
        result = await command(
            "update_weights", model_path=path, weight_version=version,
            abort_all_requests=bool(body.get("abort_all_requests") or False),
        )  # fmt: skip
        return web.json_response(result, status=200 if result["success"] else 400)

    async def not_supported(request):
        await _read_control_body(request)
        msg = f"{request.path} is not supported by the embedded server (use disk: /update_weights_from_disk)"
        return _json_error(400, msg, success=False, message=msg)

    app = web.Application(middlewares=[errors], client_max_size=256 * 1024 * 1024)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health_generate)
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, model_info)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, server_info)
    app.router.add_post("/generate", generate)
    app.router.add_post("/pause_generation", pause_generation)
    app.router.add_post("/continue_generation", continue_generation)
    app.router.add_post("/abort_request", abort_request)
    app.router.add_route("GET", "/flush_cache", flush_cache)
    app.router.add_route("POST", "/flush_cache", flush_cache)
    app.router.add_post("/update_weights_from_disk", update_weights_from_disk)
    for path in ("/init_weights_update_group", "/update_weights_from_distributed", "/update_weights_from_tensor"):
        app.router.add_post(path, not_supported)
    return app


async def _run_sequences(state: ServerState, seqs: list[Sequence]) -> None:
    """Hand sequences to the scheduler and wait until all are finished. A client that disconnects aborts them."""
    engine = state.engine
    assert engine is not None
    loop = asyncio.get_running_loop()
    futures = []
    for s in seqs:
        fut = loop.create_future()
        futures.append(fut)

        def done(seq: Sequence, fut=fut) -> None:  # runs on the scheduler thread
            def resolve() -> None:
                if not fut.done():
                    fut.set_result(seq)

            try:
                loop.call_soon_threadsafe(resolve)
            except RuntimeError:  # the loop is closed: the server is shutting down
                pass

        s.on_done = done
        state.inflight.add(s.rid)
    try:
        engine.submit(seqs)
        await asyncio.gather(*futures)
    except asyncio.CancelledError:
        for s in seqs:
            if s.finish is None:
                engine.command("abort", rid=s.rid)
        raise
    finally:
        for s in seqs:
            state.inflight.discard(s.rid)


# ==============================================================================================================
# Process entry point
# ==============================================================================================================


def load_model(args: argparse.Namespace) -> tuple[Any, Any, str]:
    """Load tokenizer + model (aliases resolved through areal_lite.models). Returns (model, tokenizer, path)."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from areal_lite.models import pick_device, resolve_model_path

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    path = resolve_model_path(args.model_path)
    if (os.path.isabs(path) or path.startswith((".", "~"))) and not os.path.isdir(os.path.expanduser(path)):
        raise FileNotFoundError(f"model folder {path} does not exist")
    device = pick_device(args.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    model.requires_grad_(False)
    return model, tokenizer, path


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m areal_lite.serve", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True, help="model folder, alias (smollm2-135m-instruct) or hub id")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, mps or auto")
    p.add_argument("--max-running-requests", type=int, default=32, help="rows decoded together")
    p.add_argument("--max-prefill-tokens", type=int, default=8192, help="padded prompt tokens per prefill batch")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 when a trainer shares the CPU)")
    p.add_argument("--context-length", type=int, default=None, help="prompt + output limit (default: model's)")
    p.add_argument("--random-seed", type=int, default=1, help="seed of the server's sampling generator")
    p.add_argument("--return-original-logprob", action="store_true",
                   help="logprobs without temperature (SGLANG_RETURN_ORIGINAL_LOGPROB=1)")  # fmt: skip
    p.add_argument("--decode-log-interval", type=int, default=40, help="log throughput every N decode steps")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    args = p.parse_args(argv)
    if args.max_running_requests < 1 or args.threads < 1 or args.max_prefill_tokens < 1:
        p.error("--max-running-requests, --threads and --max-prefill-tokens must be at least 1")
    if os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true", "yes"):
        args.return_original_logprob = True
    return args


async def _serve(args: argparse.Namespace) -> int:
    from aiohttp import web

    state = ServerState(args)
    app = build_app(state)
    # handler_cancellation: a client that hangs up cancels its handler, which aborts its requests (no wasted decode).
    runner = web.AppRunner(app, access_log=log if args.log_level == "debug" else None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()  # bind first: /health answers 503 while the model loads
    log.info("listening on http://%s:%d; loading %s", args.host, args.port, args.model_path)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not on the main thread / not on this OS
            pass

    t0 = time.perf_counter()
    # A daemon thread, not the default executor: a SIGTERM during a long load must not wait for it to finish.
    load: asyncio.Future = loop.create_future()

    def load_in_thread() -> None:
        try:
            result = load_model(args)
        except BaseException as e:
            loop.call_soon_threadsafe(lambda err=e: load.done() or load.set_exception(err))
        else:
            loop.call_soon_threadsafe(lambda: load.done() or load.set_result(result))

    threading.Thread(target=load_in_thread, name="areal-lite-load", daemon=True).start()
    waiter = asyncio.ensure_future(stop.wait())
    await asyncio.wait([load, waiter], return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():
        await runner.cleanup()
        return 0
    try:
        model, tokenizer, path = load.result()
    except Exception as e:
        log.error("failed to load model %r: %s\n%s", args.model_path, e, traceback.format_exc())
        await runner.cleanup()
        return 1
    ctx = int(getattr(model.config, "max_position_embeddings", 0) or 4096)
    if args.context_length:
        ctx = args.context_length
    engine = Engine(
        model, tokenizer, model_path=path, max_running_requests=args.max_running_requests,
        max_prefill_tokens=args.max_prefill_tokens, context_length=ctx, random_seed=args.random_seed,
        threads=args.threads, return_original_logprob=args.return_original_logprob,
        decode_log_interval=args.decode_log_interval,
    )  # fmt: skip
    engine.start()
    state.tokenizer, state.model_path, state.engine = tokenizer, path, engine
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"areal-lite serve: ready on http://{args.host}:{args.port} model={path} params={n_params / 1e6:.1f}M "
        f"device={engine.device} dtype={args.dtype} threads={args.threads} "
        f"max_running={args.max_running_requests} (loaded in {time.perf_counter() - t0:.1f}s)",
        flush=True,
    )
    await waiter
    log.info("shutting down")
    engine.stop()
    await runner.cleanup()
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from areal_lite.models import set_torch_threads

    args.threads = set_torch_threads(args.threads)  # OMP_NUM_THREADS caps it; the scheduler thread uses this count
    return asyncio.run(_serve(args))


if __name__ == "__main__":
    sys.exit(main())
