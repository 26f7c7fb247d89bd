"""SGLang's request and response bodies, as this server reads and writes them: pure functions over JSON values.

Design decisions
- Strict input checking, before anything is queued. Bodies are validated against SGLang 0.5.23's JSON contract:
  unknown `sampling_params` keys and wrong types are rejected, `16.0` is not an integer, booleans are not numbers.
  A bad body raises `BadRequest` with a message that says what to send instead; the HTTP layer answers 400 and the
  scheduler never sees it, so one bad client cannot disturb the batch of the others.
- Every body is checked against the fields SGLang defines for its route (`SGLANG_GENERATE_FIELDS`,
  `SGLANG_CONTROL_FIELDS`): SGLang ignores any other key, so a typo there (`{"mod": "retract"}`) silently gets the
  default (an abort that loses the work a retract keeps); here it is a 400 naming the nearest field, before anything
  changes.
- SGLang parameters this server does not implement (repetition penalty, min_p, grammars, ...) are accepted only at
  their neutral values and rejected otherwise, rather than silently ignored: a rollout that asks for a repetition
  penalty must not silently get none. Frequency and presence penalties are implemented (`sampling.apply_penalties`):
  SGLang clients may send both, and the OpenAI-compatible endpoint passes frequency_penalty on.
- Defaults are SGLang's: an unset `max_new_tokens` is 128, shortened to what still fits in the context; a batch with
  a single `rid` string gets `rid_0`, `rid_1`, ...; null means "default" for every sampling field.
- `GenerationState`, one row of generation, is defined here with the request it comes from and the response it
  renders into: plain data the scheduler thread owns; the HTTP side reads it only after `on_done` fired.
- No torch here: parsing is tested without a model, and the event loop imports nothing heavy to validate a body.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from areal_lite.utils.jsonhttp import BadRequest, describe

GREEDY_EPS = 1e-6  # SGLang: temperature below this means greedy
TOP_K_ALL = 1 << 30  # SGLang's "whole vocabulary"
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang 0.5.23 default
MAX_PROMPTS_PER_REQUEST = 1024
MAX_SAMPLES_PER_REQUEST = 4096
DEFAULT_WEIGHT_VERSION = "default"  # SGLang's initial weight_version
PAUSE_MODES = ("abort", "retract", "in_place")

# Every key SGLang 0.5.23 accepts in `sampling_params` (python/sglang/api/v1/api_types.py, _FIELDS_SamplingParams).
SGLANG_SAMPLING_KEYS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
)  # fmt: skip
# Every top-level field of SGLang 0.5.23's /generate body (python/sglang/srt/managers/io_struct.py,
# GenerateReqInput). Anything else is refused with the nearest of these: a misspelt `return_logprobs` must not
# quietly return no log-probs. The ones this server does not implement pass only at their neutral values.
SGLANG_GENERATE_FIELDS = (
    "rid", "session_id", "text", "input_ids", "input_embeds", "image_data", "video_data", "audio_data", "mm_hashes",
    "mm_content_hashes", "use_audio_in_video", "video_config", "sampling_params", "watermark", "return_logprob",
    "logprob_start_len", "top_logprobs_num", "token_ids_logprob", "return_sampling_mask", "sampling_logprobs_mode",
    "return_text_in_logprobs", "return_flat_raw_top_logprobs", "return_flat_raw_output_top_logprobs",
    "return_flat_raw_top_logprobs_b64", "stream", "log_metrics", "return_hidden_states", "return_routed_experts",
    "routed_experts_start_len", "return_indexer_topk", "modalities", "session_params", "lora_path", "lora_id",
    "custom_logit_processor", "positional_embed_overrides", "bootstrap_host", "bootstrap_port", "bootstrap_room",
    "bootstrap_pair_key", "decode_tp_size", "routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank",
    "routing_key", "conversation_id", "http_worker_ipc", "background", "require_reasoning", "max_thinking_tokens",
    "priority", "extra_key", "no_logs", "custom_labels", "return_bytes", "return_entropy", "return_prompt_token_ids",
    "external_trace_header", "received_time", "need_wait_for_mm_inputs", "num_items_assigned", "encoder_urls",
    "max_dynamic_patch", "min_dynamic_patch", "image_max_dynamic_patch", "video_max_dynamic_patch", "images_config",
    "mm_processor_kwargs", "multi_item_delimiter_indices", "token_indices_to_pool", "cache_salt", "kv_hints",
)  # fmt: skip
# Keys we accept but do not implement: only their neutral value is allowed (None is always allowed).
NEUTRAL_SAMPLING_VALUES: dict[str, Any] = {
    "min_p": 0.0, "repetition_penalty": 1.0,
    "stop_regex": [], "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None,
    "logit_bias": {}, "custom_params": None, "beam_width": 1, "watermark": None,
    "choice": [],
}  # fmt: skip
# Keys with no effect on this server's outputs (accepted with any well-typed value).
IGNORED_SAMPLING_KEYS = ("spaces_between_special_tokens", "stream_interval")


# ----------------------------------------------------------------------------------------------------------------
# typed values


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def want_int(where: str, v: Any) -> int:
    if not _is_int(v):
        raise BadRequest(f"{where}: expected an integer, got {describe(v)}")
    return v


def want_float(where: str, v: Any) -> float:
    if not _is_number(v):
        raise BadRequest(f"{where}: expected a number, got {describe(v)}")
    try:
        x = float(v)  # an int past 1.8e308 overflows
    except OverflowError:
        x = math.inf
    if not math.isfinite(x):
        raise BadRequest(f"{where}: must be a finite number, got {describe(v)}")
    return x


def want_bool(where: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise BadRequest(f"{where}: expected true or false, got {describe(v)}")
    return v


def _check_token_ids(where: str, ids: list, vocab_size: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise BadRequest(f"{where}: token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")


# ----------------------------------------------------------------------------------------------------------------
# sampling_params


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
    sampling_seed: Optional[int] = None  # None: the server derives the row's seed (see sampling.RowSeeds)
    frequency_penalty: float = 0.0  # lowers a generated token's logit by this times its count so far
    presence_penalty: float = 0.0  # lowers the logit of every token generated so far by this

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


def parse_sampling_params(raw: Any, vocab_size: int, where: str = "sampling_params") -> SamplingParams:
    """Validate one SGLang `sampling_params` object (strict types, SGLang's range checks)."""
    if raw is None:
        return SamplingParams()
    if not isinstance(raw, dict):
        raise BadRequest(f"{where}: expected an object, got {describe(raw)}")
    sp = SamplingParams()
    for key, v in raw.items():
        if key not in SGLANG_SAMPLING_KEYS:
            raise BadRequest(f"{where}: unknown field `{key}`, expected one of {', '.join(SGLANG_SAMPLING_KEYS)}")
        if v is not None:  # SGLang: null means "default"
            _set_sampling_field(sp, key, v, f"{where}.{key}", vocab_size)
    _check_sampling_ranges(sp, where)
    if sp.top_k >= TOP_K_ALL:
        sp.top_k = -1
    return sp


def _set_sampling_field(sp: SamplingParams, key: str, v: Any, w: str, vocab_size: int) -> None:
    """Type-check one non-null `sampling_params` value and store it on `sp` (or check it is neutral)."""
    if key in ("max_new_tokens", "min_new_tokens", "top_k", "n", "sampling_seed"):
        setattr(sp, key, want_int(w, v))
    elif key in ("temperature", "top_p", "frequency_penalty", "presence_penalty"):
        setattr(sp, key, want_float(w, v))
    elif key in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
        setattr(sp, key, want_bool(w, v))
    elif key == "stop":
        stops = [v] if isinstance(v, str) else v
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise BadRequest(f"{w}: expected a string or a list of strings, got {describe(v)}")
        sp.stop = [s for s in stops if s]  # an empty stop string would match everywhere; SGLang skips it
    elif key == "stop_token_ids":
        if not isinstance(v, list) or not all(_is_int(t) for t in v):
            raise BadRequest(f"{w}: expected a list of integers, got {describe(v)}")
        _check_token_ids(w, v, vocab_size)
        sp.stop_token_ids = list(v)
    elif key in IGNORED_SAMPLING_KEYS:
        (want_bool if key == "spaces_between_special_tokens" else want_int)(w, v)
    else:  # accepted by SGLang, not implemented here: only the neutral value passes
        neutral = NEUTRAL_SAMPLING_VALUES[key]
        if v != neutral:
            raise BadRequest(
                f"{w}: not supported by the embedded server (only {json.dumps(neutral)} or null is accepted)"
            )


def _check_sampling_ranges(sp: SamplingParams, where: str) -> None:
    """Range checks, worded like SGLang's SamplingParams.verify."""
    if sp.temperature < 0:
        raise BadRequest(f"{where}: temperature must be a non-negative finite number, got {sp.temperature}.")
    if not 0.0 < sp.top_p <= 1.0:
        raise BadRequest(f"{where}: top_p must be in (0, 1], got {sp.top_p}.")
    for name in ("frequency_penalty", "presence_penalty"):
        if not -2.0 <= getattr(sp, name) <= 2.0:
            raise BadRequest(f"{where}: {name} must be in [-2, 2], got {getattr(sp, name)}.")
    if sp.top_k != -1 and sp.top_k < 1:
        raise BadRequest(f"{where}: top_k must be -1 (disable) or at least 1, got {sp.top_k}.")
    if sp.max_new_tokens is not None and sp.max_new_tokens < 0:
        raise BadRequest(f"{where}: max_new_tokens must be at least 0, got {sp.max_new_tokens}.")
    limit = DEFAULT_MAX_NEW_TOKENS if sp.max_new_tokens is None else sp.max_new_tokens
    if not 0 <= sp.min_new_tokens <= limit:
        raise BadRequest(f"{where}: min_new_tokens must be in [0, max_new_tokens({limit})], got {sp.min_new_tokens}.")
    if sp.n < 1:
        raise BadRequest(f"{where}: n must be at least 1, got {sp.n}.")


# ----------------------------------------------------------------------------------------------------------------
# /generate


@dataclass
class PromptSpec:
    """One prompt of a /generate call, validated."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool


@dataclass(eq=False)
class GenerationState:
    """One row of generation: a prompt plus the tokens sampled for it so far (one sample of one prompt)."""

    rid: str
    parent: str  # the rid the client sent (differs from rid only for n > 1 samples)
    prompt: list[int]
    params: SamplingParams
    return_logprob: bool
    stop_ids: frozenset[int]  # EOS + stop_token_ids; empty when ignore_eos
    sample: int = 0  # which of the request's n samples this row is
    rng: Optional[random.Random] = None  # the row's own random stream (set by the scheduler on arrival)
    arrival: float = field(default_factory=time.perf_counter)
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: Optional[dict] = None
    weight_version: str = DEFAULT_WEIGHT_VERSION
    finished_at: float = 0.0
    on_done: Optional[Callable[["GenerationState"], None]] = None


def parse_generate_body(
    body: Any,
    *,
    vocab_size: int,
    context_length: int,
    tokenize: Optional[Callable[[str], list[int]]],
) -> tuple[bool, list[PromptSpec], bool]:
    """Validate a /generate body. Returns (is_batch, prompts, return_text_in_logprobs); raises BadRequest.

    `tokenize` may return any sized sequence (`range(n)`) for a text it knows cannot fit the context: only its length
    is read before such a prompt is refused."""
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {describe(body)}")
    _refuse_unsupported_fields(body)
    text_in_lp = body.get("return_text_in_logprobs")
    text_in_lp = False if text_in_lp is None else want_bool("return_text_in_logprobs", text_in_lp)
    is_batch, prompts = _prompt_token_ids(body, vocab_size, tokenize)
    params = _sampling_per_prompt(body.get("sampling_params"), is_batch, prompts, vocab_size, context_length)
    rids = _request_ids(body.get("rid"), is_batch, len(prompts))
    logprob = _per_prompt("return_logprob", body.get("return_logprob"), len(prompts), want_bool, False)
    specs = [PromptSpec(r, list(p), sp, lp) for r, p, sp, lp in zip(rids, prompts, params, logprob)]
    return is_batch, specs, text_in_lp


def _refuse_unknown_fields(body: dict, known: tuple[str, ...], route: str) -> None:
    """A top-level field SGLang's `route` does not define is a 400 naming it and the nearest field SGLang has."""
    unknown = [key for key in body if key not in known]
    if unknown:
        hints = []
        for key in unknown:
            near = difflib.get_close_matches(str(key), known, n=1)
            hints.append(f"`{key}`" + (f" (did you mean `{near[0]}`?)" if near else ""))
        has = "has no such field" if known else "reads no fields from the body"
        raise BadRequest(f"unknown field {', '.join(hints)}: SGLang's {route} {has}")


def _refuse_unsupported_fields(body: dict) -> None:
    """Top-level fields SGLang has and this server does not implement: only their neutral values pass."""
    _refuse_unknown_fields(body, SGLANG_GENERATE_FIELDS, "/generate")
    if body.get("input_embeds") is not None:
        raise BadRequest("input_embeds is not supported by the embedded server; send input_ids or text")
    if (body.get("text") is not None) == (body.get("input_ids") is not None):
        raise BadRequest("give exactly one of `text` or `input_ids`")
    if body.get("stream") not in (None, False):
        raise BadRequest("stream: streaming is not supported by the embedded server; send stream=false")
    for key, neutral in (("logprob_start_len", -1), ("top_logprobs_num", 0)):
        v = body.get(key)
        if v is None:
            continue
        values = v if isinstance(v, list) else [v]
        for x in values:
            want_int(key, x)
        if any(x != neutral for x in values):
            raise BadRequest(f"{key}: not supported by the embedded server (only {neutral} is accepted)")
    if body.get("token_ids_logprob") not in (None, []):
        raise BadRequest("token_ids_logprob: not supported by the embedded server")


def _prompt_token_ids(
    body: dict, vocab_size: int, tokenize: Optional[Callable[[str], list[int]]]
) -> tuple[bool, list[list[int]]]:
    """`text` (tokenized here) or `input_ids`, one prompt or a batch: (is_batch, token ids per prompt)."""
    if body.get("text") is not None:
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
            raise BadRequest(f"input_ids: expected a list of token ids or a list of lists, got {describe(ids)}")
        is_batch = len(ids) > 0 and all(isinstance(x, list) for x in ids)
        prompts = ids if is_batch else [ids]
        for i, p in enumerate(prompts):
            where = f"input_ids[{i}]" if is_batch else "input_ids"
            if not isinstance(p, list) or not all(_is_int(t) for t in p):
                raise BadRequest(f"{where}: expected a list of integer token ids")
            _check_token_ids(where, p, vocab_size)
    if is_batch and not prompts:
        raise BadRequest("empty batch: give at least one prompt")
    if len(prompts) > MAX_PROMPTS_PER_REQUEST:
        raise BadRequest(f"too many prompts in one request: {len(prompts)} > {MAX_PROMPTS_PER_REQUEST}")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise BadRequest(f"prompt {i} is empty (0 tokens)")
    return is_batch, prompts


def _sampling_per_prompt(
    raw: Any, is_batch: bool, prompts: list[list[int]], vocab_size: int, context_length: int
) -> list[SamplingParams]:
    """One `sampling_params` object for all prompts, or a list with one per prompt; max_new_tokens resolved."""
    count = len(prompts)
    if isinstance(raw, list):
        if not is_batch:
            raise BadRequest("sampling_params: a list is only allowed with a batch of prompts")
        if len(raw) != count:
            raise BadRequest(f"sampling_params: got {len(raw)} entries for {count} prompts")
        params = [parse_sampling_params(s, vocab_size, f"sampling_params[{i}]") for i, s in enumerate(raw)]
    else:
        params = [parse_sampling_params(raw, vocab_size)] * count
    if len({sp.n for sp in params}) > 1:
        raise BadRequest("sampling_params: n must be the same for all prompts (SGLang's rule)")
    if sum(sp.n for sp in params) > MAX_SAMPLES_PER_REQUEST:
        raise BadRequest(f"too many samples in one request (> {MAX_SAMPLES_PER_REQUEST})")
    for i, (p, sp) in enumerate(zip(prompts, params)):
        if len(p) >= context_length:
            raise BadRequest(f"prompt {i}: {len(p)} tokens, longer than the context length {context_length}")
        if sp.max_new_tokens is None:
            # As SGLang: an unset max_new_tokens is 128, shortened to what still fits; a set one must fit.
            params[i] = dataclasses.replace(sp, max_new_tokens=min(DEFAULT_MAX_NEW_TOKENS, context_length - len(p)))
        elif len(p) + sp.max_new_tokens > context_length:
            raise BadRequest(
                f"prompt {i}: {len(p)} prompt tokens + max_new_tokens {sp.max_new_tokens} exceeds the context "
                f"length {context_length}"
            )
    return params


def _request_ids(rid: Any, is_batch: bool, count: int) -> list[str]:
    """A string (suffixed per prompt in a batch, as SGLang does), one string per prompt, or None (generated)."""
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
        raise BadRequest(f"rid: expected a string or a list of strings, got {describe(rid)}")
    if len(set(rids)) != len(rids):
        raise BadRequest("rid: duplicate request ids in one batch")
    return rids


def _per_prompt(name: str, value: Any, count: int, check: Callable[[str, Any], Any], default: Any) -> list[Any]:
    """SGLang's "one value or one per prompt" fields."""
    if value is None:
        return [default] * count
    if isinstance(value, list):
        if len(value) != count:
            raise BadRequest(f"{name}: got {len(value)} values for {count} prompts")
        return [check(f"{name}[{i}]", v) for i, v in enumerate(value)]
    return [check(name, value)] * count


def render_generate_response(state: GenerationState, tokenizer: Any, text_in_logprobs: bool) -> dict:
    """The SGLang /generate response object of one finished generation."""
    sp = state.params
    ids = state.output
    matched = (state.finish or {}).get("matched")
    # A matched stop *token* stays in output_ids but leaves the text; a matched stop *string* cuts the text.
    text_ids = ids[:-1] if (isinstance(matched, int) and not sp.no_stop_trim and ids) else ids
    text = tokenizer.decode(text_ids, skip_special_tokens=sp.skip_special_tokens) if tokenizer is not None else ""
    if isinstance(matched, str) and not sp.no_stop_trim:
        cut = text.find(matched)
        if cut != -1:
            text = text[:cut]
    meta: dict[str, Any] = {
        "id": state.rid,
        "finish_reason": state.finish,
        "prompt_tokens": len(state.prompt),
        "completion_tokens": len(ids),
        "cached_tokens": 0,
        "weight_version": state.weight_version,
        "e2e_latency": round(state.finished_at - state.arrival, 6),
    }
    if state.return_logprob:
        meta["output_token_logprobs"] = [
            [lp, tok, tokenizer.decode([tok]) if text_in_logprobs else None] for lp, tok in zip(state.logprobs, ids)
        ]
    return {"text": text, "output_ids": list(ids), "meta_info": meta}


# ----------------------------------------------------------------------------------------------------------------
# control endpoints

# Every field of SGLang 0.5.23's control bodies: the request types of python/sglang/srt/managers/io_struct.py that
# its http_server.py reads each route's body into, with the `rid` and `http_worker_ipc` every one inherits from
# BaseReq (FastAPI reads a body into all of a struct's fields: srt/utils/msgspec_utils.py). SGLang drops any other
# key without a word, so a misspelt `mode` or `abort_all` quietly does the default; here it is refused.
_BASE_REQ_FIELDS = ("rid", "http_worker_ipc")
SGLANG_CONTROL_FIELDS: dict[str, tuple[str, ...]] = {
    "/pause_generation": (*_BASE_REQ_FIELDS, "mode"),  # PauseGenerationReqInput
    "/continue_generation": (*_BASE_REQ_FIELDS, "torch_empty_cache"),  # ContinueGenerationReqInput
    "/abort_request": (  # AbortReq
        *_BASE_REQ_FIELDS, "abort_all", "finished_reason", "abort_message", "weight_versions",
    ),
    "/update_weights_from_disk": (  # UpdateWeightFromDiskReqInput
        *_BASE_REQ_FIELDS, "model_path", "load_format", "abort_all_requests", "weight_version", "is_async",
        "torch_empty_cache", "keep_pause", "recapture_cuda_graph", "token_step", "flush_cache", "manifest",
    ),
    "/load_lora_adapter": (*_BASE_REQ_FIELDS, "lora_name", "lora_path", "pinned", "lora_id"),  # LoadLoRAAdapterReqInput
    "/unload_lora_adapter": (*_BASE_REQ_FIELDS, "lora_name", "lora_id"),  # UnloadLoRAAdapterReqInput
    "/flush_cache": (),  # SGLang's handler reads no body (its only parameter, `timeout`, is in the query string)
}  # fmt: skip
# Control fields SGLang defines and this server does not act on: only their neutral value (or null) passes, so a
# client that asks for something (a `keep_pause`, a `load_format`) is told it does not get it.
NEUTRAL_CONTROL_VALUES: dict[str, Any] = {
    "rid": None, "http_worker_ipc": None, "finished_reason": None, "abort_message": None, "weight_versions": None,
    "load_format": None, "is_async": False, "keep_pause": False, "token_step": 0, "manifest": None,
}  # fmt: skip
# Flags about GPU memory and caches this server does not keep (no CUDA graphs, no prefix cache): either value gives
# the same answers, so any true or false passes.
IGNORED_CONTROL_FLAGS = ("torch_empty_cache", "recapture_cuda_graph", "flush_cache")


def check_control_fields(route: str, body: dict, acted_on: tuple[str, ...] = ()) -> None:
    """A control body's fields before its own checks: none that SGLang's `route` lacks, and those this server does
    not act on (all but `acted_on`, which the route's parser checks) at values that change nothing."""
    _refuse_unknown_fields(body, SGLANG_CONTROL_FIELDS[route], route)
    for key, v in body.items():
        if key in acted_on or v is None:  # null means "default", as in /generate
            continue
        if key in IGNORED_CONTROL_FLAGS:
            want_bool(key, v)
            continue
        neutral = NEUTRAL_CONTROL_VALUES[key]
        if v != neutral or type(v) is not type(neutral):  # `0` is not `false`, nor `false` a `0`
            only = "null" if neutral is None else f"{json.dumps(neutral)} or null"
            raise BadRequest(f"{key}: not supported by the embedded server (only {only} is accepted)")


def parse_pause_body(body: dict) -> str:
    """/pause_generation: the pause mode (SGLang's default is "abort")."""
    check_control_fields("/pause_generation", body, ("mode",))
    mode = body.get("mode", "abort") or "abort"
    if mode not in PAUSE_MODES:
        raise BadRequest(f"mode: expected 'abort', 'retract' or 'in_place', got {describe(mode)}")
    return mode


def parse_abort_body(body: dict) -> tuple[str, bool]:
    """/abort_request: (rid, abort_all); an empty rid matches nothing unless abort_all."""
    check_control_fields("/abort_request", body, ("rid", "abort_all"))
    rid = body.get("rid", "")
    rid = "" if rid is None else rid
    if not isinstance(rid, str):
        raise BadRequest(f"rid: expected a string, got {describe(rid)}")
    abort_all = body.get("abort_all", False)
    abort_all = False if abort_all is None else want_bool("abort_all", abort_all)
    return rid, abort_all


@dataclass
class WeightUpdate:
    """A validated /update_weights_from_disk request."""

    model_path: str
    weight_version: Optional[str] = None  # None: the current version plus 1
    abort_all_requests: bool = False


def parse_update_weights_body(body: dict) -> WeightUpdate:
    check_control_fields("/update_weights_from_disk", body, ("model_path", "weight_version", "abort_all_requests"))
    path = body.get("model_path")
    if not isinstance(path, str) or not path:
        raise BadRequest("model_path: expected a non-empty string (a folder of *.safetensors files)")
    version = body.get("weight_version")
    if version is not None and not isinstance(version, str):
        raise BadRequest(f"weight_version: expected a string or null, got {describe(version)}")
    abort_all = body.get("abort_all_requests")
    abort_all = False if abort_all is None else want_bool("abort_all_requests", abort_all)
    return WeightUpdate(path, version, abort_all)


def weight_update_result(success: bool, message: str) -> dict:
    """SGLang's /update_weights_from_disk response body."""
    return {"success": success, "message": message, "num_paused_requests": 0}


# ----------------------------------------------------------------------------------------------------------------
# LoRA adapters (SGLang's /load_lora_adapter and /unload_lora_adapter; the server side is `lora.py`)


@dataclass
class LoraUpdate:
    """A validated /load_lora_adapter (`lora_path` set) or /unload_lora_adapter (`lora_path` None) request."""

    lora_name: str
    lora_path: Optional[str] = None
    abort_all_requests: bool = False  # as a weight update's: loads wait for the running batch instead


def _want_name(body: dict, key: str) -> str:
    v = body.get(key)
    if not isinstance(v, str) or not v:
        raise BadRequest(f"{key}: expected a non-empty string, got {describe(v)}")
    return v


def parse_load_lora_body(body: dict) -> LoraUpdate:
    """SGLang's LoadLoRAAdapterReqInput: lora_name, lora_path (a folder with adapter_config.json and
    adapter_model.safetensors), optional pinned and lora_id (accepted; one adapter is active at a time anyway)."""
    check_control_fields("/load_lora_adapter", body, ("lora_name", "lora_path", "pinned", "lora_id"))
    name, path = _want_name(body, "lora_name"), _want_name(body, "lora_path")
    if body.get("pinned") is not None:
        want_bool("pinned", body["pinned"])
    _check_lora_id(body)
    return LoraUpdate(name, path)


def _check_lora_id(body: dict) -> None:
    """SGLang's lora_id (its tokenizer manager makes one up when unset): any string passes, one adapter is active at
    a time anyway."""
    if body.get("lora_id") is not None and not isinstance(body["lora_id"], str):
        raise BadRequest(f"lora_id: expected a string or null, got {describe(body['lora_id'])}")


def parse_unload_lora_body(body: dict) -> LoraUpdate:
    """SGLang's UnloadLoRAAdapterReqInput: lora_name, optional lora_id."""
    check_control_fields("/unload_lora_adapter", body, ("lora_name", "lora_id"))
    _check_lora_id(body)
    return LoraUpdate(_want_name(body, "lora_name"))


def lora_update_result(success: bool, message: str, loaded: dict) -> dict:
    """SGLang's LoRAUpdateOutput body."""
    return {"success": success, "error_message": None if success else message, "loaded_adapters": loaded}


def parse_lora_paths(body: Any, count: int) -> list[Optional[str]]:
    """A /generate body's `lora_path`: null, one adapter name for every prompt, or one (or null) per prompt."""
    raw = body.get("lora_path") if isinstance(body, dict) else None

    def check(where: str, v: Any) -> Optional[str]:
        if v is not None and (not isinstance(v, str) or not v):
            raise BadRequest(f"{where}: expected an adapter name (a non-empty string) or null, got {describe(v)}")
        return v

    return _per_prompt("lora_path", raw, count, check, None)
