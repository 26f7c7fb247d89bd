"""Experiment configuration: the dataclasses with AReaL's names, and AReaL's `load_expr_config` for them.

Design decisions
- The dataclasses keep AReaL-lite's names and nesting (`GRPOConfig.actor.optimizer.lr`, `config.gconfig`,
  `config.rollout`, `config.sglang`, ...) so a notebook cell moves between the two projects with little change.
  Every field carries a one-line help in `metadata["help"]` (CleanRL style); `describe(cls)` returns them as text.
- The schema is here, how text becomes a config is not: `config_loader` does the strict YAML, override and profile
  layering for any dataclass (re-exported here: `describe`, `resolve_profile`). What stays is what knows these
  fields: `load_expr_config` fills the fields given once for several sections (the group size, the model path, the
  names) and reconciles those that must agree (`reconcile_temperature`, `reconcile_lora`).
- SGLang's wire format (`sampling_params`) lives with its HTTP client, `infra.remote_inf_engine`; the api layer
  never imports the engines.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from areal_lite.api.areal_only import (
    AgentConfig,
    ArchonEngineConfig,
    ArchonFP8Config,
    ClusterSpecConfig,
    ConfigError,
    DistributedDataParallelConfig,
    FP8EngineConfig,
    FSDPEngineConfig,
    FSDPWrapPolicy,
    MegatronEngineConfig,
    MemoryProfilerConfig,
    NameResolveConfig,
    PerfTracerConfig,
    SchedulerConfig,
    SchedulingSpec,
    SchedulingStrategy,
    SessionTracerConfig,
    SwanlabConfig,
    TensorBoardConfig,
    TrackioConfig,
    WandBConfig,
    _f,
    note_once,
    report_areal_only,
)
from areal_lite.api.config_loader import LoadedConfig, describe, load_layers, resolve_profile

__all__ = [
    "ConfigError",
    "GenerationHyperparameters",
    "InferenceEngineConfig",
    "OptimizerConfig",
    "MicroBatchSpec",
    "NormConfig",
    "PPOActorConfig",
    "SGLangConfig",
    "EmbeddedServerConfig",
    "vLLMConfig",
    "DatasetConfig",
    "TrainDatasetConfig",
    "ValidDatasetConfig",
    "TrainEngineConfig",
    "PPOCriticConfig",
    "TeacherConfig",
    "PPOConfig",
    "AgentConfig",
    "ArchonEngineConfig",
    "ArchonFP8Config",
    "ClusterSpecConfig",
    "DistributedDataParallelConfig",
    "FP8EngineConfig",
    "FSDPEngineConfig",
    "FSDPWrapPolicy",
    "MegatronEngineConfig",
    "MemoryProfilerConfig",
    "NameResolveConfig",
    "PerfTracerConfig",
    "RejectionSamplingConfig",
    "SchedulerConfig",
    "SchedulingSpec",
    "SchedulingStrategy",
    "SessionTracerConfig",
    "SwanlabConfig",
    "TensorBoardConfig",
    "TrackioConfig",
    "WandBConfig",
    "parse_backend",
    "server_backend",
    "SaverConfig",
    "StatsLoggerConfig",
    "EvaluatorConfig",
    "RecoverConfig",
    "BaseExperimentConfig",
    "GRPOConfig",
    "load_expr_config",
    "resolve_profile",
    "describe",
    "default_weight_update_dir",
]


# --------------------------------------------------------------------------------------------------------------
# Generation
# --------------------------------------------------------------------------------------------------------------


@dataclass
class GenerationHyperparameters:
    """How one request is sampled: AReaL 1.0.4's fields, order and defaults (a YAML or cell moves unchanged).

    `n_samples` is the GRPO group size, given here once; workflows send `gconfig.new(n_samples=1)` per request and
    the engine's `group_size=` runs the group. `max_new_tokens` bounds one request; `max_tokens` bounds prompt +
    output (the engine lowers `max_new_tokens` to what `max_tokens` leaves, as AReaL's does).
    """

    n_samples: int = _f(1, "number of samples per prompt (the GRPO group size)")
    max_new_tokens: int = _f(16384, "maximum number of tokens generated per request")
    min_new_tokens: int = _f(0, "minimum number of tokens generated before a stop can end the request")
    max_tokens: int = _f(32768, "maximum number of tokens of prompt plus output")
    greedy: bool = _f(False, "greedy decoding (overrides temperature, top_p, top_k)")
    top_p: float = _f(1.0, "nucleus sampling probability mass, in (0, 1]")
    top_k: int = _f(int(1e8), "sample from the k most likely tokens (1e8 or more, or <= 0: all)")
    temperature: float = _f(1.0, "sampling temperature; 0 also means greedy")
    stop_token_ids: List[int] = _f(help="extra token ids that end the request (EOS always does)", factory=list)
    ignore_eos: bool = _f(False, "keep generating after EOS (benchmarks only)")
    skip_special_tokens: bool = _f(True, "the server skips special tokens when it detokenizes (text output only)")
    stop: Optional[List[str]] = _f(None, "stop strings; the request ends when one appears in the output")
    frequency_penalty: float = _f(0.0, "penalty on tokens by their frequency so far, in [-2, 2]")
    lora_name: str = _f("default_lora", "LoRA adapter name: requests ask for <lora_name>-v<version> (use_lora)")
    use_beam_search: bool = _f(False, "beam search (AReaL's vLLM backend only; the kit refuses it)")

    def new(self, **kwargs: Any) -> "GenerationHyperparameters":
        """A copy with some fields changed: `gconfig.new(n_samples=1)`."""
        unknown = set(kwargs) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"GenerationHyperparameters has no field(s) {sorted(unknown)}")
        return dataclasses.replace(self, **kwargs)

    def new_with_stop_and_pad_token_ids(self, tokenizer) -> "GenerationHyperparameters":
        """A copy whose `stop_token_ids` also hold the tokenizer's pad and EOS ids (what AReaL's workflows do)."""
        ids = list(self.stop_token_ids)
        for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
            if tid is not None and tid not in ids:
                ids.append(tid)
        return self.new(stop_token_ids=ids)


# --------------------------------------------------------------------------------------------------------------
# Inference side
# --------------------------------------------------------------------------------------------------------------


_RPC_SERVER = "python -m areal.infra.rpc.rpc_server"  # AReaL's worker command (its scheduler's default)


@dataclass
class InferenceEngineConfig:
    """The rollout client and executor: AReaL 1.0.4's fields, order and defaults; the kit-only field comes last.

    `backend` is AReaL's `"<server>:<parallelism>"` (`sglang:d1`, `vllm:d1`, or the kit's `embedded:d1`); its prefix
    picks the server (see `server_backend`). Empty (the kit's default; AReaL requires it) leaves the choice to the
    experiment's kit-only `backend` switch."""

    experiment_name: Optional[str] = _f(None, "experiment name; None: the experiment's")
    trial_name: Optional[str] = _f(None, "trial name; None: the experiment's")
    fileroot: Optional[str] = _f(None, "root of logs and trajectory dumps; None: the experiment's")
    max_concurrent_rollouts: Optional[int] = _f(None, "episodes running at once; None means consumer_batch_size")
    queue_size: Optional[int] = _f(None, "finished-episode queue bound; None means unbounded")
    consumer_batch_size: int = _f(1, "episodes the trainer consumes per step (B in the staleness rule)")
    max_head_offpolicyness: int = _f(0, "staleness bound eta: how many versions a rollout may lag (0 = synchronous)")
    enable_rollout_tracing: bool = _f(False, "log a line per generation request (AReaL's executor)")
    check_trajectory_format: bool = _f(False, "check every episode's tensors (keys, shapes, dtypes): for debugging")
    tokenizer_path: str = _f("", "tokenizer that decodes dumped trajectories; empty: the experiment's")
    dump_to_file: bool = _f(False, "write every finished episode as a JSON line under fileroot")
    setup_timeout: float = _f(120.0, "seconds to wait for the servers to become healthy")
    request_timeout: float = _f(3600.0, "total seconds one generation request may take, retries included")
    request_retries: int = _f(3, "retries of a failed HTTP request before giving up")
    pause_grace_period: float = _f(0.0, "seconds to wait after /pause_generation (AReaL's client)")
    scheduling_spec: Tuple[SchedulingSpec, ...] = _f(
        help="AReaL scheduler: resources of the inference workers", factory=lambda: (SchedulingSpec(cmd=_RPC_SERVER),)
    )
    backend: str = _f("", "server and parallelism, e.g. sglang:d1, vllm:d1, embedded:d1; empty: the `backend` switch")
    scheduling_strategy: SchedulingStrategy = _f(
        help="AReaL scheduler: separate or colocated", factory=SchedulingStrategy
    )
    use_lora: bool = _f(False, "requests ask for the trained LoRA adapter (must equal actor.use_lora)")
    lora_name: str = _f("", "LoRA adapter name when gconfig.lora_name is empty")
    agent: AgentConfig = _f(
        help="AReaL's agent-service rollouts (OpenAI proxy)",
        factory=lambda: AgentConfig(agent_cls_path="areal.experimental.openai.proxy.online_agent._OnlineAgent"),
    )
    return_routed_experts: bool = _f(False, "return MoE routed expert ids (SGLang, MoE models)")
    _version: str = _f("v1", "AReaL rollout controller version", choices=("v1", "v2"))
    model: str = _f("default", "model name exposed by AReaL's inference-service gateway")
    routing_strategy: str = _f("round_robin", "routing strategy of AReaL's inference-service router")
    poll_interval: float = _f(5.0, "health-poll interval (s) of AReaL's inference-service router")
    admin_api_key: str = _f("areal-admin-key", "admin API key of AReaL's inference-service gateway")
    api_url: Optional[str] = _f(None, "external OpenAI-compatible base URL (AReaL's external model mode)")
    provider_api_key: Optional[str] = _f(None, "API key of that external provider")
    pause_poll_interval: float = _f(0.05, "seconds between checks while generation is paused (kit-only)")

    def __post_init__(self) -> None:
        report_areal_only(self)
        if self.backend and not self.backend.startswith("${"):
            parse_backend(self.backend, "rollout.backend", ("sglang", "vllm", "embedded"))


def parse_backend(spec: str, key: str, allowed: Tuple[str, ...]) -> Tuple[str, Dict[str, int]]:
    """AReaL's `"<name>:<parallelism>"` (`sglang:d4p1t1`, `fsdp:d1`): (name, {"d": 4, "p": 1, "t": 1}).

    The kit runs one server process and one training process, so any degree above 1 is reported as having no effect
    (once); an unknown name is a ConfigError."""
    name, _, par = spec.partition(":")
    if name not in allowed:
        raise ConfigError(f"{key}={spec!r}: the prefix must be one of {list(allowed)}")
    degrees: Dict[str, int] = {}
    for letter, digits in re.findall(r"([a-z])(\d+)", par):
        degrees[letter] = int(digits)
    if re.sub(r"[a-z]\d+", "", par):
        raise ConfigError(f"{key}={spec!r}: write the parallelism as AReaL does, e.g. {name}:d1 or {name}:d2t2")
    if any(v > 1 for v in degrees.values()):
        note_once(key, f"parallel degrees other than 1 ({par}) have no effect in the kit: one process runs it")
    return name, degrees


def server_backend(config: Any) -> str:
    """The server a whole experiment config asks for: `sglang`, `vllm`, `embedded` or `auto`.

    Precedence: `rollout.backend` (AReaL's field) names the server when set; otherwise the kit-only top-level
    `backend` switch decides (`auto` included). Both set to different servers is a ConfigError that names the two, so
    a kit profile (`backend: embedded`) never silently overrides an AReaL YAML's `rollout.backend: sglang:d1`."""
    switch = getattr(config, "backend", "auto") or "auto"
    rollout = getattr(getattr(config, "rollout", None), "backend", "") or ""
    if not rollout:
        return switch
    name, _ = parse_backend(rollout, "rollout.backend", ("sglang", "vllm", "embedded"))
    if switch not in ("auto", name):
        raise ConfigError(
            f"rollout.backend={rollout!r} asks for {name} but backend={switch!r} (the kit's switch) asks for "
            f"{switch}: set one of them, or both to the same server"
        )
    return name


@dataclass
class SGLangConfig:
    """Arguments of `python -m sglang.launch_server` (GPU route): AReaL 1.0.4's fields and order; the kit-only field
    comes last. The kit's own settings are always passed; a field the kit added from AReaL is passed only when set
    to something other than AReaL's default, so a default launch is the one the kit has always made."""

    model_path: str = _f("", "model folder or hub id; empty means the actor's path")
    random_seed: int = _f(1, "server sampling seed")
    skip_tokenizer_init: bool = _f(False, "serve token ids only (breaks stop strings; keep False)")
    disable_cuda_graph: bool = _f(False, "disable CUDA graphs (slower, less memory)")
    disable_radix_cache: bool = _f(False, "disable prefix caching")
    disable_cuda_graph_padding: bool = _f(False, "no CUDA graph when the batch size needs padding")
    enable_nccl_nvls: bool = _f(False, "NCCL NVLS for prefill-heavy all-reduce")
    disable_outlines_disk_cache: bool = _f(False, "no disk cache of compiled grammars")
    disable_custom_all_reduce: bool = _f(False, "use NCCL's all-reduce instead of SGLang's own")
    disable_overlap_schedule: bool = _f(False, "no overlap of CPU scheduling with GPU work")
    enable_mixed_chunk: bool = _f(False, "mix prefill chunks and decodes in one batch")
    enable_dp_attention: bool = _f(False, "data-parallel attention (MoE models)")
    enable_ep_moe: bool = _f(False, "expert parallelism for MoE layers")
    enable_torch_compile: bool = _f(False, "torch.compile the model")
    torch_compile_max_bs: int = _f(32, "largest batch size torch.compile covers")
    cuda_graph_max_bs: Optional[int] = _f(None, "largest batch size captured in CUDA graphs")
    cuda_graph_bs: Optional[List[int]] = _f(None, "batch sizes captured in CUDA graphs")
    torchao_config: str = _f("", "torchao quantisation config")
    enable_nan_detection: bool = _f(False, "check the sampled logits for NaN")
    enable_p2p_check: bool = _f(False, "check GPU peer-to-peer access")
    triton_attention_reduce_in_fp32: bool = _f(False, "Triton attention reduces in float32")
    triton_attention_num_kv_splits: int = _f(8, "KV splits of the Triton decode attention")
    num_continuous_decode_steps: int = _f(1, "decode steps run before the scheduler looks again")
    enable_memory_saver: bool = _f(False, "release/resume memory (torch_memory_saver)")
    allow_auto_truncate: bool = _f(False, "truncate requests longer than the context instead of failing")
    attention_backend: Optional[str] = _f(None, "attention kernel backend; None lets SGLang choose")
    enable_multimodal: bool = _f(False, "serve image inputs")
    sampling_backend: Optional[str] = _f(None, "sampling kernel backend; None lets SGLang choose")
    context_length: Optional[int] = _f(None, "maximum context length; None means the model's")
    mem_fraction_static: Optional[float] = _f(0.8, "fraction of GPU memory for weights and KV cache")
    max_running_requests: Optional[int] = _f(None, "maximum concurrent requests in the server")
    chunked_prefill_size: Optional[int] = _f(None, "prefill chunk size in tokens")
    max_prefill_tokens: int = _f(32768, "maximum tokens in one prefill batch")
    schedule_policy: str = _f("lpm", "request scheduling policy", choices=("lpm", "random", "fcfs", "dfs-weight"))
    schedule_conservativeness: float = _f(1.0, "how conservatively new requests are admitted")
    cpu_offload_gb: int = _f(0, "GiB of weights kept in CPU memory")
    dtype: str = _f("bfloat16", "weights dtype", choices=("auto", "half", "float16", "bfloat16", "float", "float32"))
    kv_cache_dtype: str = _f("auto", "KV cache dtype")
    dp_size: int = _f(1, "data-parallel server replicas in one launch")
    ep_size: int = _f(1, "expert-parallel size")
    enable_lora: Optional[bool] = _f(None, "serve LoRA adapters")
    max_lora_rank: Optional[int] = _f(None, "largest LoRA rank served (unset in a LoRA run: actor.lora_rank)")
    max_loaded_loras: int = _f(8, "LoRA adapters kept loaded")
    lora_paths: Optional[List[str]] = _f(None, "LoRA adapters loaded at start")
    lora_backend: str = _f("triton", "LoRA kernel backend")
    log_level: str = _f("warning", "server log level", choices=("debug", "info", "warning", "error"))
    log_level_http: Optional[str] = _f("warning", "HTTP access log level")
    log_requests: bool = _f(False, "log every request")
    log_requests_level: int = _f(0, "how much of each request is logged")
    show_time_cost: bool = _f(False, "log the time of each server stage")
    enable_metrics: bool = _f(False, "expose Prometheus metrics")
    decode_log_interval: int = _f(40, "log decode statistics every N steps")
    enable_multithread_load: bool = _f(False, "load the weights with several threads")
    enable_return_routed_experts: bool = _f(False, "return MoE routed expert ids")
    trust_remote_code: bool = _f(False, "allow custom model code from the model folder (kit-only)")

    def __post_init__(self) -> None:
        report_areal_only(self)

    @staticmethod
    def build_cmd(
        sglang_config: "SGLangConfig",
        tp_size: int = 1,
        base_gpu_id: int = 0,
        host: str = "127.0.0.1",
        port: int = 30000,
        dist_init_addr: Optional[str] = None,
        model_path: Optional[str] = None,
    ) -> List[str]:
        """The argv that starts SGLang with these settings (a list, never a shell string)."""
        args: Dict[str, Any] = {
            f.name: getattr(sglang_config, f.name)
            for f in dataclasses.fields(sglang_config)
            if f.name in _SGLANG_KIT_FLAGS
            or (f.name not in SGLANG_NOT_IN_PINNED and getattr(sglang_config, f.name) != f.default)
        }
        if model_path:
            args["model_path"] = model_path
        if not args["model_path"]:
            raise ConfigError("sglang.model_path is empty: pass model_path= or set sglang.model_path")
        args.update(tp_size=tp_size, base_gpu_id=base_gpu_id, host=host, port=port)
        if dist_init_addr:
            args["dist_init_addr"] = dist_init_addr
        if sglang_config.enable_lora and not sglang_config.lora_paths:
            # with no adapter at start SGLang needs the modules to reserve adapter memory for: any the actor adapts
            args["lora_target_modules"] = "all"
        cmd = [sys.executable, "-m", "sglang.launch_server"]
        for key, value in args.items():
            if value is None or value is False:
                continue
            flag = "--" + key.replace("_", "-")
            if value is True:
                cmd.append(flag)
            elif isinstance(value, (list, tuple)):
                cmd += [flag, *map(str, value)]
            else:
                cmd += [flag, str(value)]
        return cmd


# AReaL's SGLang fields that the SGLang release the kit pins has no flag for (AReaL drops them by version too):
# never passed, and reported once when set (areal_only.AREAL_ONLY_FIELDS).
SGLANG_NOT_IN_PINNED = frozenset({"enable_ep_moe", "enable_nan_detection", "enable_multithread_load", "torchao_config"})

# The SGLang settings the kit has always passed (whatever their value); AReaL's others only when changed.
_SGLANG_KIT_FLAGS = frozenset(
    "model_path random_seed skip_tokenizer_init disable_cuda_graph disable_radix_cache dtype context_length "
    "mem_fraction_static max_running_requests chunked_prefill_size max_prefill_tokens schedule_policy "
    "schedule_conservativeness attention_backend log_level log_level_http log_requests decode_log_interval "
    "enable_metrics trust_remote_code".split()
)


@dataclass
class EmbeddedServerConfig:
    """Arguments of `python -m areal_lite.kit.server`, the small SGLang-compatible server for CPU (and CUDA without
    SGLang).

    The server's options are defined here and nowhere else: the server builds its command-line parser from these
    fields (flag `--max-running-requests` for field `max_running_requests`, help from the field's metadata), and
    `cli_args()` turns a config back into those flags, so an option added here is settable from a YAML config, the
    launcher and the command line at once. Host, port and the sampling seed belong to one launch, not to the
    config: the launcher passes them itself."""

    model_path: str = _f("", "model folder or alias; empty means the actor's path")
    dtype: str = _f(
        "float32",
        "weights dtype; auto: bfloat16 where this machine measures it faster and batch-exact (kit/server/precision.py)",
        choices=("float32", "bfloat16", "float16", "auto"),
    )
    device: str = _f("auto", "cpu, cuda, cuda:N or auto: CUDA when present, else the CPU")
    max_running_requests: int = _f(32, "requests decoded together in one batch")
    max_prefill_tokens: int = _f(8192, "padded prompt tokens per prefill batch")
    threads: int = _f(1, "torch threads of the server process (1 when a trainer shares the CPU)")
    context_length: Optional[int] = _f(None, "maximum prompt + output tokens; None means the model's")
    return_original_logprob: bool = _f(False, "logprobs without temperature (as SGLANG_RETURN_ORIGINAL_LOGPROB=1)")
    decode_log_interval: int = _f(40, "log decode throughput every N decode steps (0: never)")
    fast_path: bool = _f(True, "Llama/Qwen2: fused forward over an in-place KV cache (no: the model's own forward)")
    log_level: str = _f("info", "server log level", choices=("debug", "info", "warning", "error"))

    def cli_args(self) -> List[str]:
        """This config as `python -m areal_lite.kit.server` flags: `--flag value` per field, booleans as `--flag` or
        `--no-flag`. A field that is None or "" is left out, so the server's default (the same field's) applies."""
        args: List[str] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None or value == "":
                continue
            flag = "--" + f.name.replace("_", "-")
            if isinstance(value, bool):
                args.append(flag if value else f"--no-{flag[2:]}")
            else:
                args += [flag, str(value)]
        return args


@dataclass
class vLLMConfig:
    """Arguments of vLLM's OpenAI-compatible server (`backend=vllm`), run from its own interpreter (`make vllm`
    builds `.venv-vllm`: vLLM pins its own transformers). AReaL 1.0.4's class name, fields and order; the kit-only
    fields come last. `areal_lite.kit.server.launch` turns a config into the argv: the fields it always maps, and any of
    `VLLM_FLAGS_WHEN_SET` set to a non-default value."""

    model: str = _f("", "model folder or alias; empty means the actor's path")
    seed: int = _f(1, "server sampling seed (a whole experiment config passes its own seed)")
    skip_tokenizer_init: bool = _f(False, "serve token ids only")
    enforce_eager: bool = _f(False, "no CUDA graphs / torch.compile (always on without CUDA: compiling takes minutes)")
    dtype: str = _f("", "weights dtype (float32, bfloat16, ...); empty means the actor's dtype")
    distributed_executor_backend: str = _f("mp", "how vLLM runs its workers (AReaL: mp)")
    max_num_seqs: int = _f(256, "requests decoded together in one batch")
    block_size: int = _f(16, "tokens per KV cache block")
    cpu_offload_gb: float = _f(0, "GiB of weights kept in CPU memory")
    disable_sliding_window: bool = _f(True, "disable sliding-window attention (the kit leaves it to vLLM)")
    max_model_len: Optional[int] = _f(None, "maximum prompt + output tokens; None means the model's")
    no_enable_chunked_prefill: bool = _f(False, "disable chunked prefill")
    no_enable_prefix_caching: bool = _f(False, "disable prefix caching (the client resets it after a weight update)")
    gpu_memory_utilization: float = _f(0.9, "fraction of GPU memory for weights and KV cache (GPU only)")
    worker_extension_cls: str = _f(
        "areal.engine.vllm_ext.vllm_worker_extension.VLLMWorkerExtension", "AReaL's worker extension (the kit: its own)"
    )
    enable_sleep_mode: bool = _f(False, "let the server release GPU memory while idle")
    uvicorn_log_level: str = _f("warning", "HTTP log level", choices=("debug", "info", "warning", "error"))
    gdn_prefill_backend: Optional[str] = _f(
        None, "GDN prefill backend of hybrid models", choices=("triton", "flashinfer")
    )
    enable_lora: bool = _f(False, "serve LoRA adapters")
    max_lora_rank: int = _f(16, "largest LoRA rank served")
    max_loras: int = _f(8, "LoRA adapters in one batch")
    lora_modules: Optional[List[str]] = _f(None, "LoRA adapters loaded at start")
    python: str = _f("", "interpreter with vLLM installed; empty: .venv-vllm/bin/python of this checkout (kit-only)")
    threads: int = _f(1, "torch threads of the server process on CPU (capped by OMP_NUM_THREADS) (kit-only)")
    cpu_kv_cache_gb: int = _f(1, "KV cache size in GiB on CPU (vLLM reserves 90% of RAM otherwise) (kit-only)")
    logprobs_mode: str = _f(
        "processed_logprobs",
        "processed_logprobs: after temperature (SGLang's default); raw_logprobs: before (--return-original-logprob)",
        choices=("processed_logprobs", "raw_logprobs"),
    )

    def __post_init__(self) -> None:
        report_areal_only(self)


# The ranks vLLM 0.32 can reserve adapter memory for (its `MaxLoRARanks`; tests/test_vllm.py reads vLLM's own).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# vLLM flags the launcher passes only when set to something other than the default (AReaL's fields the kit's
# launch never needed); `areal_lite.kit.server.launch` reads this list.
VLLM_FLAGS_WHEN_SET = ("skip_tokenizer_init", "block_size", "cpu_offload_gb", "no_enable_chunked_prefill",
                       "enable_sleep_mode", "gdn_prefill_backend")  # fmt: skip


# --------------------------------------------------------------------------------------------------------------
# Training side
# --------------------------------------------------------------------------------------------------------------


DATASET_TYPES = (
    "gsm8k",
    "arith",
    "products",
    "factbook_qa",
    "rl",
    "sft",
    "rw",
    "dpo",
)  # the kit's data, then AReaL's methods


@dataclass
class OptimizerConfig:
    type: str = _f(
        "adam", "optimizer (AdamW); adam_bf16 is AReaL's bfloat16-state Adam", choices=("adam", "sgd", "adam_bf16")
    )
    lr: float = _f(1e-5, "peak learning rate")
    weight_decay: float = _f(0.0, "decoupled weight decay")
    beta1: float = _f(0.9, "Adam beta1")
    beta2: float = _f(0.999, "Adam beta2")
    eps: float = _f(1e-8, "Adam epsilon")
    min_lr_ratio: float = _f(0.0, "final learning rate as a fraction of lr (linear/cosine schedules)")
    lr_scheduler_type: str = _f("constant", "learning-rate schedule", choices=("linear", "cosine", "constant"))
    warmup_steps_proportion: float = _f(0.0, "fraction of total steps spent warming up linearly")
    initial_loss_scale: float = _f(4294967296.0, "initial fp16 loss scale (AReaL's Megatron engine)")
    min_loss_scale: float = _f(1.0, "smallest fp16 loss scale")
    loss_scale_window: float = _f(5, "steps between fp16 loss-scale increases")
    hysteresis: int = _f(2, "overflows tolerated before the fp16 loss scale drops")
    gradient_clipping: float = _f(1.0, "clip the global gradient norm to this value (0 disables)")

    def __post_init__(self) -> None:
        report_areal_only(self)


@dataclass
class MicroBatchSpec:
    n_mbs: Optional[int] = _f(1, "minimum number of micro-batches per mini-batch")
    granularity: int = _f(1, "adjacent rows kept in one micro-batch (AReaL's packer)")
    max_tokens_per_mb: Optional[int] = _f(None, "token budget of one packed micro-batch; None means no limit")
    n_mbs_divisor: int = _f(1, "the micro-batch count is rounded to a multiple of this (AReaL's packer)")
    packing_algorithm: str = _f("ffd", "AReaL's packing algorithm: ffd or kk", choices=("ffd", "kk"))

    def __post_init__(self) -> None:
        report_areal_only(self)


@dataclass
class NormConfig:
    """Reward/advantage normalisation: AReaL 1.0.4's fields, order, defaults and checks. A level of None (AReaL's
    spelling; the kit also takes the string "none", which a YAML `none` gives) means no centring / no scaling."""

    mean_level: Optional[str] = _f(
        "batch", "where the mean is taken; None: not centred", choices=("batch", "group", None, "none")
    )
    mean_leave1out: bool = _f(False, "leave-one-out mean: each sample's mean excludes itself")
    std_level: Optional[str] = _f(
        "batch", "where the standard deviation is taken; None: not scaled", choices=("batch", "group", None, "none")
    )
    std_unbiased: bool = _f(True, "unbiased (N-1) standard deviation")
    eps: float = _f(1e-5, "added to the standard deviation")
    group_size: int = _f(1, "rows per group (contiguous); set from gconfig.n_samples when left at 1")

    def __post_init__(self) -> None:
        # AReaL's messages (its tests match them), with the kit's "none" alias named.
        if self.mean_level not in _NORM_LEVELS:
            raise ValueError(f"mean_level must be 'batch', 'group' or None (or 'none'), got {self.mean_level}")
        if self.std_level not in _NORM_LEVELS:
            raise ValueError(f"std_level must be 'batch', 'group', or None (or 'none'), got {self.std_level}")
        if "group" in (self.mean_level, self.std_level) and self.group_size < 1:
            raise ValueError(
                f"group_size must be a positive integer when using group normalization, got {self.group_size}"
            )


_NORM_LEVELS = ("batch", "group", None, "none")


@dataclass
class TrainEngineConfig:
    """A training engine: AReaL 1.0.4's fields, order and defaults; the kit-only fields come last. `backend` is
    AReaL's `"fsdp:d1"`: the kit's engine is FSDP-style, so its prefix must be fsdp; empty (the kit's default;
    AReaL requires it) means fsdp:d1."""

    experiment_name: str = _f("areal-lite", "experiment name (used in paths)")
    trial_name: str = _f("trial0", "trial name (used in paths)")
    path: str = _f("", "model folder, alias (smollm2-135m-instruct) or hub id")
    attn_impl: str = _f(
        "flash_attention_2",
        "AReaL's attention implementation (the kit's engine picks its own)",
        choices=("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention"),
    )
    use_kernels: bool = _f(False, "kernelize the model with Hugging Face kernels")
    init_from_scratch: bool = _f(False, "random initial weights instead of the pretrained ones")
    is_critic: bool = _f(False, "a critic/reward model (value head)")
    temperature: float = _f(1.0, "sampling temperature the logprobs are computed at")
    mb_spec: MicroBatchSpec = _f(help="micro-batch split", factory=MicroBatchSpec)
    pad_to_maximum: bool = _f(False, "pad each micro-batch to the token budget (less fragmentation, slower)")
    disable_dropout: bool = _f(False, "set every dropout probability to 0 for training")
    gradient_checkpointing: bool = _f(False, "recompute activations in backward to save memory")
    dtype: str = _f(
        "float32",
        "training dtype; bfloat16 on a CPU: float32 weights and optimizer state, forward passes under bf16 autocast "
        "if the CPU has AVX-512 BF16 or AMX and bf16 measures faster there, else float32 (AREAL_LITE_CPU_BF16=1 "
        "forces, 0 forbids the autocast)",
        choices=("float32", "bfloat16", "float16"),
    )
    grad_reduce_dtype: str = _f("float32", "dtype of the gradient reduction across ranks")
    optimizer_dtype: str = _f("float32", "dtype of the parameter storage and optimizer states")
    optimizer: Optional[OptimizerConfig] = _f(
        help="optimizer settings (AReaL: None means no training)", factory=OptimizerConfig
    )
    weight_update_mode: str = _f(
        "xccl", "how new weights reach the servers (the kit: always disk)", choices=("disk", "xccl")
    )
    fsdp: FSDPEngineConfig = _f(help="AReaL's FSDP engine options", factory=FSDPEngineConfig)
    archon: ArchonEngineConfig = _f(help="AReaL's Archon engine options", factory=ArchonEngineConfig)
    megatron: MegatronEngineConfig = _f(help="AReaL's Megatron engine options", factory=MegatronEngineConfig)
    offload: bool = _f(False, "offload parameters and optimizer states to CPU")
    use_lora: bool = _f(False, "train a LoRA adapter instead of every weight")
    lora_rank: int = _f(32, "LoRA rank")
    lora_alpha: int = _f(16, "LoRA alpha")
    target_modules: List[str] = _f(help="modules LoRA adapts; empty: every linear layer of the decoder", factory=list)
    peft_type: str = _f("lora", "PEFT method (LoRA only)")
    enable_tree_training: bool = _f(False, "tree training with flex attention")
    scheduling_spec: Tuple[SchedulingSpec, ...] = _f(
        help="AReaL scheduler: resources of the training workers", factory=lambda: (SchedulingSpec(cmd=_RPC_SERVER),)
    )
    backend: str = _f("", "engine and parallelism, e.g. fsdp:d1; empty: fsdp:d1")
    _version: str = _f("v1", "AReaL train controller version", choices=("v1", "v2"))
    admin_api_key: str = _f("areal-admin-key", "admin API key of AReaL's controller v2 gateway")
    log_level: str = _f("warning", "log level of AReaL's controller v2 gateway")
    request_timeout: float = _f(3600.0, "request timeout (s) of AReaL's controller v2 gateway")
    setup_timeout: float = _f(3600.0, "setup timeout (s) of AReaL's controller v2 gateway")
    scheduling_strategy: SchedulingStrategy = _f(
        help="AReaL scheduler: separate or colocated", factory=SchedulingStrategy
    )
    device: str = _f("auto", "cpu, cuda, cuda:N or auto: CUDA when present, else the CPU (kit-only)")
    threads: int = _f(0, "torch threads of the trainer (0: torch's default) (kit-only)")
    seed: int = _f(1, "trainer random seed (kit-only)")

    def __post_init__(self) -> None:
        report_areal_only(self)
        if self.backend and not self.backend.startswith("${"):
            parse_backend(self.backend, "actor.backend", ("fsdp",))


_RS_LEVELS = ("token", "sequence")
_RS_ACTIONS = ("mask", "clamp")
_RS_METRICS = ("ratio", "kl_k1", "kl_k2", "kl_k3")
_RS_AGGS = ("sum", "mean", "max")


@dataclass
class RejectionSamplingConfig:
    """Which stale tokens (or sequences) the decoupled loss drops or down-weights: AReaL 1.0.4's fields, defaults,
    checks and warning. The metric compares the proximal policy with the behaviour policy that sampled the token:
    the ratio pi_prox / pi_behav, or a KL estimate of log(pi_prox / pi_behav). `mask` drops what falls outside
    [lower, upper]; `clamp` keeps it with its weight clamped into that range (ratio only; lower then defaults to 0).
    At sequence level the per-token metric is aggregated first (the ratio in log space: `mean` is the geometric
    mean, as GSPO's), and with the ratio metric every token of a sequence takes the sequence's weight."""

    level: str = _f("token", "filter each token, or each sequence as a whole", choices=_RS_LEVELS)
    action: str = _f(
        "mask", "mask: drop from the loss; clamp: keep with the weight clamped to [lower, upper]", choices=_RS_ACTIONS
    )
    metric: str = _f("ratio", "pi_prox / pi_behav, or a KL estimate (k1 may be negative)", choices=_RS_METRICS)
    agg: str = _f("mean", "how a sequence's token metrics combine (level=sequence only)", choices=_RS_AGGS)
    upper: float = _f(5.0, "largest metric kept (ratio: must be > 1; kl_k2/kl_k3: must be > 0)")
    lower: Optional[float] = _f(None, "smallest metric kept (ratio: must be > 0); None: no lower bound")

    def __post_init__(self) -> None:
        # AReaL's checks and messages (its tests match them).
        for name, allowed in (("level", _RS_LEVELS), ("action", _RS_ACTIONS), ("metric", _RS_METRICS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got '{getattr(self, name)}'")
        if self.agg not in _RS_AGGS:
            raise ValueError(f"agg must be one of {_RS_AGGS}, got '{self.agg}'")
        if self.lower is not None and self.lower > self.upper:
            raise ValueError(f"lower ({self.lower}) cannot be greater than upper ({self.upper})")
        if self.metric == "ratio" and self.upper <= 1.0:
            raise ValueError(
                "upper must be > 1.0 for 'ratio' metric (otherwise all non-identical policy tokens will be "
                f"filtered), got {self.upper}"
            )
        if self.metric == "ratio" and self.lower is not None and self.lower <= 0:
            raise ValueError(f"lower must be positive for 'ratio' metric, got {self.lower}")
        if self.metric in ("kl_k2", "kl_k3") and self.upper <= 0:
            raise ValueError(f"upper must be positive for '{self.metric}' metric, got {self.upper}")
        if self.action == "clamp" and self.metric != "ratio":
            raise ValueError(
                "action='clamp' only supports metric='ratio' (direct importance weight truncation). "
                f"Got metric='{self.metric}'. Use action='mask' for KL-based filtering."
            )
        if self.action == "clamp" and self.lower is None:
            self.lower = 0.0  # a weight is never negative: clamping from below at 0 changes nothing
        if self.level == "token" and self.agg != "mean":
            warnings.warn(
                f"agg='{self.agg}' is ignored when level='token'. Aggregation is only used for sequence-level "
                "filtering.",
                UserWarning,
                stacklevel=2,
            )


@dataclass
class PPOActorConfig(TrainEngineConfig):
    """The policy: `TrainEngineConfig` plus AReaL 1.0.4's PPO fields, order and defaults; kit-only fields last."""

    ppo_n_minibatches: int = _f(1, "optimizer steps per training batch")
    eps_clip: float = _f(0.2, "PPO clip epsilon (lower side)")
    eps_clip_higher: Optional[float] = _f(None, "upper clip epsilon (clip-higher); None means eps_clip")
    c_clip: Optional[float] = _f(None, "dual-clip constant c > 1; None disables")
    m2_threshold: Optional[float] = _f(None, "second-moment threshold of M2PO")
    reward_norm: Optional[NormConfig] = _f(None, "normalise rewards (None: no normalisation)")
    reward_scaling: float = _f(1.0, "reward shaping: multiply after adding the bias")
    reward_bias: float = _f(0.0, "reward shaping: added before scaling")
    reward_clip: float = _f(20.0, "reward shaping: clip to [-reward_clip, reward_clip]")
    overlong_reward_penalty: bool = _f(False, "DAPO's penalty on answers that run into the length limit")
    overlong_tokens: Optional[int] = _f(None, "tail tokens that receive the overlong penalty")
    overlong_penalty_factor: Optional[float] = _f(None, "size of the overlong penalty")
    mask_no_eos_with_zero: bool = _f(False, "leave answers without EOS (truncated) out of the loss")
    discount: float = _f(1.0, "discount factor of future rewards (GAE gamma)")
    gae_lambda: float = _f(1.0, "GAE lambda")
    adv_norm: Optional[NormConfig] = _f(None, "normalise advantages (None: no normalisation)")
    kl_ctl: float = _f(0.0, "KL penalty coefficient to the reference model (0: none)")
    kl_estimator: str = _f("k1", "KL estimator", choices=("k1", "k2", "k3"))
    use_sapo_loss: bool = _f(False, "SAPO loss instead of PPO clipping")
    sapo_tau_pos: float = _f(1.0, "SAPO temperature for positive advantages")
    sapo_tau_neg: float = _f(1.05, "SAPO temperature for negative advantages")
    recompute_logprob: bool = _f(True, "recompute proximal logprobs with the trainer's weights")
    use_decoupled_loss: bool = _f(True, "decoupled PPO: proximal policy from recomputed logprobs")
    rejection_sampling: Optional[RejectionSamplingConfig] = _f(
        None, "drop stale tokens (token/mask/ratio with `upper` is the kit's behav_imp_weight_cap); None: keep all"
    )
    importance_sampling_level: str = _f(
        "token", "importance ratios per token or per sequence", choices=("token", "sequence")
    )
    prox_logp_method: str = _f(
        "recompute", "how the proximal log-probs are obtained", choices=("recompute", "loglinear", "metrics")
    )
    log_agent_stats: bool = _f(False, "log statistics of agent trajectories")
    log_agent_stats_keys: List[str] = _f(help="keys of those statistics", factory=list)
    max_new_tokens: int = _f(1024, "generation limit the overlong penalty measures against")
    group_size: int = _f(1, "GRPO group size; set from gconfig.n_samples when left at 1 (kit-only)")
    behav_imp_weight_cap: Optional[float] = _f(
        None, "drop tokens whose behaviour importance weight exceeds this (AReaL's old name; kit-only)"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.behav_imp_weight_cap = _cap_from_rejection_sampling(self.rejection_sampling, self.behav_imp_weight_cap)


def _cap_from_rejection_sampling(rs: Optional[RejectionSamplingConfig], cap: Optional[float]) -> Optional[float]:
    """AReaL 1.0.4's `rejection_sampling` as the kit's `behav_imp_weight_cap` (AReaL migrates the old name the same
    way): token level, mask action, ratio metric, an upper bound only. Anything else changes which tokens train and
    the kit does not implement it: a ConfigError, never a silent substitute."""
    if rs is None:
        if cap is not None and cap <= 1.0:  # the loss checks it as AReaL's rejection_sampling.upper; fail here first
            raise ConfigError(f"actor.behav_imp_weight_cap must be > 1 (a cap <= 1 drops most tokens), got {cap}")
        return cap
    if (rs.level, rs.action, rs.metric, rs.lower) != ("token", "mask", "ratio", None):
        raise ConfigError(
            f"actor.rejection_sampling={rs}: the kit implements only level=token, action=mask, metric=ratio with an "
            "upper bound (its behav_imp_weight_cap)"
        )
    if cap is not None and cap != rs.upper:
        raise ConfigError(
            f"actor.rejection_sampling.upper={rs.upper} and actor.behav_imp_weight_cap={cap} disagree: set one"
        )
    return float(rs.upper)


@dataclass
class PPOCriticConfig(TrainEngineConfig):
    """AReaL's critic (value model) section; the kit trains GRPO without one, so `GRPOConfig.critic` is refused."""

    ppo_n_minibatches: int = _f(4, "optimizer steps per training batch")
    eps_clip: float = _f(0.5, "value-loss clip epsilon")
    mask_no_eos_with_zero: bool = _f(False, "leave answers without EOS out of the loss")


@dataclass
class TeacherConfig:
    """AReaL's on-policy distillation teacher; the kit has no distillation, so `GRPOConfig.teacher` is refused."""

    engine_type: str = _f(
        "rollout", "rollout: score with an inference engine; train: a train engine", choices=("rollout", "train")
    )
    rollout: Optional[InferenceEngineConfig] = _f(None, "the teacher's inference engine")
    train: Optional[PPOActorConfig] = _f(None, "the teacher's train engine (engine_type=train)")
    path: str = _f("", "teacher model path")
    offload: bool = _f(False, "offload the teacher between steps")
    rl_loss_weight: float = _f(1.0, "weight of the RL loss")
    distill_loss_weight: float = _f(0.005, "weight of the distillation loss")


@dataclass
class DatasetConfig:
    """A dataset (AReaL's `_DatasetConfig`): AReaL 1.0.4's fields and order; the kit-only fields come last.

    `type` takes AReaL's training method (`rl`, `sft`: then the data is named by `path`, e.g. `openai/gsm8k`) or
    one of the kit's packaged datasets (`gsm8k`, `arith`, `factbook_qa`, `products`); the two sets of names do not
    overlap."""

    split: str = _f("train", "dataset split")
    path: Optional[str] = _f(None, "local JSON/JSONL file, hub id, or None for the packaged offline data")
    type: str = _f(
        "gsm8k",
        "the kit's packaged data, or AReaL's method (rl, sft, ...) with data named by path",
        choices=DATASET_TYPES,
    )
    batch_size: int = _f(4, "prompts per training step")
    shuffle: bool = _f(True, "shuffle each epoch (seeded)")
    pin_memory: bool = _f(False, "pin host memory (AReaL's loader)")
    num_workers: int = _f(0, "loader worker processes (AReaL's loader)")
    num_dataset_workers: int = _f(1, "AReaL's remote data-service workers")
    drop_last: bool = _f(True, "drop the last incomplete batch")
    max_length: Optional[int] = _f(None, "drop prompts longer than this many tokens")
    dataset_kwargs: Dict[str, Any] = _f(help="extra arguments of AReaL's dataset loader", factory=dict)
    scheduling_spec: Optional[SchedulingSpec] = _f(
        help="AReaL's remote data-service workers",
        factory=lambda: SchedulingSpec(cpu=1, mem=10, cmd="python3 -m areal.infra.rpc.guard"),
    )
    setup_timeout: float = _f(120.0, "seconds AReaL's data service may take to load the data")
    size: Optional[int] = _f(None, "number of rows to generate or keep; None means all/default (kit-only)")
    seed: int = _f(0, "data seed (kit-only)")

    def __post_init__(self) -> None:
        report_areal_only(self)


@dataclass
class TrainDatasetConfig(DatasetConfig):
    """The training data (AReaL's name)."""


@dataclass
class ValidDatasetConfig(DatasetConfig):
    """The held-out data (AReaL's name and defaults: the test split, in order, every row)."""

    split: str = _f("test", "dataset split")
    shuffle: bool = _f(False, "shuffle each epoch (seeded)")
    drop_last: bool = _f(False, "drop the last incomplete batch")


@dataclass
class _Timer:
    experiment_name: str = _f("", "experiment name; empty: the experiment's (AReaL: required)")
    trial_name: str = _f("", "trial name; empty: the experiment's (AReaL: required)")
    fileroot: str = _f("", "root folder; empty: the experiment's (AReaL: required)")
    freq_epochs: Optional[int] = _f(None, "every N epochs; None disables")
    freq_steps: Optional[int] = _f(None, "every N steps; None disables")
    freq_secs: Optional[int] = _f(None, "every N seconds; None disables")

    def __post_init__(self) -> None:
        report_areal_only(self)


@dataclass
class SaverConfig(_Timer):
    mode: str = _f("auto", "AReaL's save mode: sync, async or auto", choices=("auto", "sync", "async"))
    keep_last: int = _f(2, "checkpoints kept on disk (kit-only)")


@dataclass
class EvaluatorConfig(_Timer):
    eval_before_train: bool = _f(True, "evaluate once before training (the kit's trainer always does)")
    size: int = _f(32, "held-out problems per evaluation (kit-only)")


@dataclass
class RecoverConfig(_Timer):
    mode: str = _f(
        "disabled",
        "recover from this run's last checkpoint: on/auto when one exists, off/disabled never (--resume forces on)",
        choices=("on", "off", "auto", "disabled"),
    )
    retries: int = _f(3, "AReaL's launcher retries; the kit has no launcher and runs once")
    no_save_optim: bool = _f(False, "leave the optimizer state out of recovery checkpoints")
    no_load_optim: bool = _f(False, "do not load the optimizer state when recovering")


@dataclass
class StatsLoggerConfig:
    """Where per-step statistics go. AReaL 1.0.4's sections; `wandb.mode` and the kit-only `wandb_mode` are one
    setting (either may be set; set to different values they are a ConfigError)."""

    experiment_name: str = _f("", "experiment name; empty: the experiment's (AReaL: required)")
    trial_name: str = _f("", "trial name; empty: the experiment's (AReaL: required)")
    fileroot: str = _f("", "root folder; empty: the experiment's (AReaL: required)")
    wandb: WandBConfig = _f(help="Weights & Biases (the kit reads `mode`)", factory=WandBConfig)
    swanlab: SwanlabConfig = _f(help="SwanLab (not in the kit)", factory=SwanlabConfig)
    tensorboard: TensorBoardConfig = _f(help="TensorBoard: on when `path` is set", factory=TensorBoardConfig)
    trackio: TrackioConfig = _f(help="Trackio (not in the kit)", factory=TrackioConfig)
    wandb_mode: str = _f(
        "disabled",
        "Weights & Biases mode (kit-only name of wandb.mode)",
        choices=("disabled", "offline", "online", "shared"),
    )

    def __post_init__(self) -> None:
        for section in (self, self.wandb, self.tensorboard):
            report_areal_only(section)
        modes = {self.wandb.mode, self.wandb_mode} - {"disabled"}
        if len(modes) > 1:
            raise ConfigError(
                f"stats_logger.wandb.mode={self.wandb.mode!r} and stats_logger.wandb_mode={self.wandb_mode!r} disagree"
            )
        self.wandb.mode = self.wandb_mode = modes.pop() if modes else "disabled"


@dataclass
class BaseExperimentConfig:
    """AReaL 1.0.4's experiment fields, order and defaults (names have kit defaults: AReaL requires them); the
    kit-only fields come last."""

    experiment_name: str = _f("areal-lite", "experiment name")
    trial_name: str = _f("trial0", "trial name")
    cluster: ClusterSpecConfig = _f(help="AReaL's cluster (nodes, GPUs, name resolving)", factory=ClusterSpecConfig)
    allocation_mode: str = _f("", "AReaL's deprecated GPU allocation; use rollout.backend / actor.backend")
    seed: int = _f(1, "global random seed")
    enable_offload: bool = _f(False, "AReaL's training offload (torch_memory_saver)")
    total_train_epochs: int = _f(1, "passes over the training data")
    total_train_steps: Optional[int] = _f(None, "stop after this many steps (None: epochs decide)")
    total_train_n_seqs: Optional[int] = _f(None, "stop after this many sequences (AReaL; None: epochs decide)")
    tokenizer_path: str = _f("", "tokenizer folder, alias or hub id; empty means actor.path")
    train_dataset: TrainDatasetConfig = _f(help="training data", factory=TrainDatasetConfig)
    valid_dataset: Optional[ValidDatasetConfig] = _f(None, "held-out data for evaluation")
    saver: SaverConfig = _f(help="checkpointing", factory=SaverConfig)
    evaluator: EvaluatorConfig = _f(help="periodic evaluation", factory=EvaluatorConfig)
    stats_logger: StatsLoggerConfig = _f(help="where per-step statistics go", factory=StatsLoggerConfig)
    perf_tracer: Optional[PerfTracerConfig] = _f(None, "AReaL's perf tracer; None disables")
    memory_profiler: Optional[MemoryProfilerConfig] = _f(None, "AReaL's memory profiler; None disables")
    recover: RecoverConfig = _f(help="resuming a crashed run", factory=RecoverConfig)
    sglang: SGLangConfig = _f(help="SGLang server arguments (GPU)", factory=SGLangConfig)
    vllm: vLLMConfig = _f(help="vLLM server arguments (backend=vllm, CPU or GPU)", factory=vLLMConfig)
    scheduler: SchedulerConfig = _f(help="AReaL's scheduler", factory=SchedulerConfig)
    fileroot: str = _f("runs", "root folder for logs, checkpoints and weight updates (kit-only)")
    profile: str = _f(
        "auto",
        "hardware profile: cpu, gpu, or auto (gpu when CUDA is available) (kit-only)",
        choices=("auto", "cpu", "gpu"),
    )

    def __post_init__(self) -> None:
        report_areal_only(self)


@dataclass
class PPOConfig(BaseExperimentConfig):
    gconfig: GenerationHyperparameters = _f(help="sampling for training rollouts", factory=GenerationHyperparameters)
    eval_gconfig: Optional[GenerationHyperparameters] = _f(
        help="sampling for evaluation (AReaL: None means gconfig)",
        factory=lambda: GenerationHyperparameters(greedy=True),
    )
    rollout: InferenceEngineConfig = _f(help="rollout client and executor", factory=InferenceEngineConfig)
    actor: PPOActorConfig = _f(help="policy model and PPO settings", factory=PPOActorConfig)
    ref: Optional[PPOActorConfig] = _f(None, "reference model for the KL penalty (None: no reference)")
    critic: Optional[PPOCriticConfig] = _f(None, "AReaL's critic (not in the kit)")
    teacher: Optional[TeacherConfig] = _f(None, "AReaL's distillation teacher (not in the kit)")
    dynamic_bs: bool = _f(False, "AReaL's dynamic batch size in prepare_batch (not in the kit)")
    backend: str = _f(
        "auto",
        "inference server: sglang, embedded, vllm (opt-in: make vllm), or auto (sglang if installed and CUDA); "
        "rollout.backend, when set, decides (kit-only)",
        choices=("auto", "sglang", "embedded", "vllm"),
    )
    embedded: EmbeddedServerConfig = _f(help="embedded server arguments (CPU) (kit-only)", factory=EmbeddedServerConfig)
    async_training: bool = _f(False, "overlap rollout and training (prepare_batch) instead of rollout_batch (kit-only)")
    weight_update_dir: str = _f(
        "", "folder for disk weight updates; empty: /dev/shm if present, else under fileroot (kit-only)"
    )


@dataclass
class GRPOConfig(PPOConfig):
    """AReaL's GRPO experiment: the PPO experiment's fields (GRPO is PPO with group-normalised rewards)."""


# --------------------------------------------------------------------------------------------------------------
# Loading: AReaL's entry point, and the rules that tie the sections together
# --------------------------------------------------------------------------------------------------------------


# Kit defaults that differ from AReaL 1.0.4's and change what is learned, with AReaL's value and why the kit keeps
# its own (a one-machine run, no reference model by default). `load_expr_config` prints the ones a config leaves at
# the kit default; `areal_lite.kit.areal.config` writes the kit's value explicitly into the AReaL YAML;
# tests/test_areal_config.py checks this table against the installed AReaL, and that it is complete.
AREAL_DEFAULT_DIFFERENCES: Dict[str, tuple] = {
    "actor.dtype": ("bfloat16", "CPUs train in float32: bf16 pays only on some CPUs with AVX-512 BF16 or AMX"),
    "actor.ppo_n_minibatches": (4, "small CPU batches: one optimizer step per batch"),
    "actor.kl_ctl": (0.1, "no reference model unless `ref` is set"),
    "actor.use_decoupled_loss": (False, "asynchronous rollouts need the proximal policy"),
    "actor.recompute_logprob": (False, "the decoupled loss needs recomputed log-probs"),
    "actor.optimizer.lr": (0.001, "1e-5 suits full fine-tuning of a small LM"),
    "actor.optimizer.weight_decay": (0.01, "a few hundred steps: no decay"),
    "actor.optimizer.warmup_steps_proportion": (0.001, "no warm-up for short runs"),
    "rollout.setup_timeout": (300.0, "a local server starts in seconds"),
}

# The other intentional differences: how a run is set up, not what it learns (server launch flags, placeholders
# AReaL's examples always set, sections AReaL leaves None). Not printed; tests/test_areal_fields.py checks that
# this table and the one above hold every difference. AReaL's required fields ('???': names, backends, dataset
# path and type) get a kit default everywhere, so a notebook runs without naming them; that rule is not listed.
AREAL_SETUP_DIFFERENCES: Dict[str, tuple] = {
    "actor.optimizer": (None, "AReaL: None means no training; the kit's actor trains unless told otherwise"),
    "eval_gconfig": (None, "AReaL: None means gconfig; the kit evaluates greedily"),
    "evaluator.eval_before_train": (False, "the kit's trainer evaluates before the first step, to show the change"),
    "train_dataset.batch_size": (1, "AReaL's placeholder; every example sets it"),
    "valid_dataset.batch_size": (1, "AReaL's placeholder; every example sets it"),
    "sglang.disable_radix_cache": (True, "prefix caching helps GRPO groups; the client flushes it on weight updates"),
    "sglang.attention_backend": ("fa3", "fa3 runs on Hopper only: SGLang picks a kernel for the GPU at hand"),
    "sglang.context_length": (32768, "None: the model's own (SmolLM2 has 8192)"),
    "sglang.mem_fraction_static": (0.9, "0.8 leaves room for the trainer on a shared GPU"),
    "sglang.chunked_prefill_size": (-1, "None: SGLang's choice for the GPU"),
    "sglang.enable_metrics": (True, "no Prometheus on a notebook machine"),
    "sglang.decode_log_interval": (1, "a log line every 40 decode steps, not every step"),
    "vllm.dtype": ("bfloat16", "empty: the actor's dtype (float32 on CPU)"),
    "vllm.max_model_len": (32768, "None: the model's own"),
    "vllm.no_enable_prefix_caching": (True, "prefix caching helps GRPO groups; the client resets it on updates"),
}


def load_expr_config(
    argv: List[str], config_cls: type = GRPOConfig, *, verbose: bool = True, explain_defaults: bool = False
) -> tuple[Any, Optional[str]]:
    """Parse `["--config", FILE, "a.b=1", ...]` into a `config_cls` instance. Returns `(config, path_of_file)`.

    Order: dataclass defaults ← YAML base keys ← YAML `profiles.<profile>` ← `$AREAL_LITE_OVERRIDES` ← `argv`
    (`config_loader.load_layers`); then the fields derived from others are filled and checked (`_fill_derived`).
    The profile comes from `profile=` in argv, else `$AREAL_LITE_PROFILE`, else `profile=` in
    `$AREAL_LITE_OVERRIDES`, else the YAML, else `auto`.
    `verbose` prints the profile chosen and why; `explain_defaults` also lists the kit defaults this config leaves in
    place that differ from AReaL 1.0.4's, with the reason for each (notebook 01 shows them once, where configs are
    taught, rather than every notebook repeating them before they mean anything).
    """
    loaded = load_layers(argv, config_cls)
    _check_values(loaded)
    _fill_derived(loaded.config)
    if verbose:
        shown = os.path.basename(loaded.path) if loaded.path else "defaults"
        print(f"areal-lite: profile={loaded.profile} ({loaded.why}) config={shown}")
    if explain_defaults:
        _print_default_differences(loaded)
    return loaded.config, loaded.path


def _print_default_differences(loaded: LoadedConfig) -> None:
    differ = [
        (key, _get_dotted(loaded.config, key), areal, why)
        for key, (areal, why) in AREAL_DEFAULT_DIFFERENCES.items()
        if not loaded.sets(key) and _has_dotted(loaded.config, key)
    ]
    if not differ:
        print("areal-lite: this config sets every key whose kit default differs from AReaL 1.0.4's")
        return
    print("areal-lite: kit defaults left in place that differ from AReaL 1.0.4's:")
    for key, ours, areal, why in differ:
        print(f"  {key} = {ours!r} (AReaL: {areal!r}): {why}")


def _has_dotted(obj: Any, dotted: str) -> bool:
    try:
        _get_dotted(obj, dotted)
        return True
    except AttributeError:
        return False


def _get_dotted(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def reconcile_temperature(actor: Any, gconfig: Any) -> None:
    """The one temperature rule: the trainer recomputes log-probs at the temperature the servers sampled at.

    Servers report log-probs of the temperature-scaled distribution (as SGLang does), so any other temperature in
    the trainer makes every importance ratio wrong. The temperature is given once, as `gconfig.temperature`:
    `actor.temperature` left at its default 1.0 follows it; a different explicit value is a ConfigError. Greedy
    decoding (or temperature 0) samples no distribution, so the actor keeps its own value.
    """
    if gconfig.greedy or gconfig.temperature == 0.0 or actor.temperature == gconfig.temperature:
        return
    if actor.temperature == 1.0:
        actor.temperature = gconfig.temperature
        return
    raise ConfigError(
        f"actor.temperature={actor.temperature} differs from gconfig.temperature={gconfig.temperature}: "
        "behaviour and recomputed log-probs would disagree; leave actor.temperature at 1.0 (it follows "
        "gconfig.temperature) or set both to the same value"
    )


def reconcile_lora(config: Any) -> None:
    """LoRA is one switch on two sides: the actor trains an adapter (`actor.use_lora`) and the rollout client asks
    the servers for it (`rollout.use_lora`). They must agree, and the server must be launched to accept adapters, as
    AReaL asks: the embedded server always does; SGLang with `sglang.enable_lora=true` (same routes; not yet run by
    us on a GPU), whose `sglang.max_lora_rank`, when unset, becomes `actor.lora_rank`; vLLM with
    `vllm.enable_lora=true` and a `vllm.max_lora_rank` no smaller than `actor.lora_rank`.
    """
    actor, rollout = getattr(config, "actor", None), getattr(config, "rollout", None)
    if actor is None or rollout is None:
        return
    if bool(actor.use_lora) != bool(rollout.use_lora):
        raise ConfigError(
            f"actor.use_lora={actor.use_lora} and rollout.use_lora={rollout.use_lora} disagree: the trainer would "
            "send one kind of weights and the servers expect the other; set both to the same value"
        )
    if not actor.use_lora:
        return
    backend = server_backend(config) if hasattr(config, "backend") else "auto"
    server = getattr(config, backend, None) if backend in ("sglang", "vllm") else None
    if server is None:
        return
    if not server.enable_lora:
        route = "/load_lora_adapter" if backend == "sglang" else "/v1/load_lora_adapter"
        raise ConfigError(
            f"actor.use_lora=true with backend {backend} needs {backend}.enable_lora=true so the server accepts {route}"
        )
    # The server sizes its adapter memory at start: SGLang from the adapters in lora_paths, else from max_lora_rank
    # (AReaL preloads its first adapter; the kit syncs version 0 after start, so it gives the rank); vLLM from
    # max_lora_rank, whose default is AReaL's (16).
    if backend == "sglang" and server.max_lora_rank is None:
        server.max_lora_rank = actor.lora_rank
    elif backend == "vllm" and server.max_lora_rank not in VLLM_LORA_RANKS:
        raise ConfigError(
            f"vllm.max_lora_rank={server.max_lora_rank}: vLLM accepts only {', '.join(map(str, VLLM_LORA_RANKS))}; "
            f"take the smallest of them that is at least actor.lora_rank={actor.lora_rank}"
        )
    elif server.max_lora_rank < actor.lora_rank:
        raise ConfigError(
            f"{backend}.max_lora_rank={server.max_lora_rank} is below actor.lora_rank={actor.lora_rank}: "
            f"{'SGLang' if backend == 'sglang' else 'vLLM'} would refuse the adapter; raise it"
            + (" or leave it unset (it then follows actor.lora_rank)" if backend == "sglang" else "")
        )


def _model_aliases() -> Any:
    from areal_lite.utils.model_store import MODEL_REGISTRY

    return MODEL_REGISTRY


def _check_values(loaded: Any) -> None:
    """Refuse values, set by a file, profile or override, that their types allow but no run can use, naming the
    key: at load, not steps later in a traceback from the code that first trips on them. (A default left empty, as
    `actor.path` in a config that sets it in code later, is not checked.)"""
    from areal_lite.utils.device import DEVICE_CHOICES, is_device_name  # torch: loading a config needs it anyway

    rules = (
        ("experiment_name", "a non-empty name", lambda v: bool(str(v).strip())),
        ("trial_name", "a non-empty name (the run's folder)", lambda v: bool(str(v).strip())),
        ("actor.path", "a model folder, alias or hub id", lambda v: bool(str(v).strip())),
        ("actor.optimizer.lr", "a finite number >= 0", lambda v: math.isfinite(v) and v >= 0),
        # AReaL's null optimizer marks an engine that does not train (a reference model); the actor trains
        (
            "actor.optimizer",
            "an optimizer section (the actor trains; delete the line for the defaults)",
            lambda v: v is not None,
        ),
        ("gconfig.n_samples", "an integer >= 1", lambda v: v >= 1),
        ("gconfig.max_new_tokens", "an integer >= 1", lambda v: v >= 1),
        ("gconfig.temperature", "a finite number >= 0", lambda v: math.isfinite(v) and v >= 0),
        ("gconfig.top_p", "a number in (0, 1]", lambda v: 0 < v <= 1),
        ("train_dataset.batch_size", "an integer >= 1", lambda v: v >= 1),
        ("valid_dataset.batch_size", "an integer >= 1", lambda v: v >= 1),
        ("rollout.consumer_batch_size", "an integer >= 1", lambda v: v >= 1),
        (
            "rollout.max_concurrent_rollouts",
            "an integer >= 1, or null (consumer_batch_size)",
            lambda v: v is None or v >= 1,
        ),
        ("rollout.max_head_offpolicyness", "an integer >= 0", lambda v: v >= 0),
        ("actor.ppo_n_minibatches", "an integer >= 1", lambda v: v >= 1),
        ("actor.eps_clip", "a finite number > 0", lambda v: math.isfinite(v) and v > 0),
        ("total_train_epochs", "an integer >= 1", lambda v: v >= 1),
        # 0 is a run of the starting evaluation alone
        ("total_train_steps", "an integer >= 0, or null (the epochs decide)", lambda v: v is None or v >= 0),
        *((f"{section}.device", DEVICE_CHOICES, is_device_name) for section in ("actor", "ref", "embedded")),
    )
    for dotted, expected, ok in rules:
        if not loaded.sets(dotted):
            continue
        value = loaded.config
        for part in dotted.split("."):
            value = getattr(value, part, None)
        # A set value is None only for an optional field (the loader refuses null for any other): here a section
        if not ok(value):
            raise ConfigError(f"{loaded.source_of(dotted)}: key '{dotted}': expected {expected}, got {value!r}")


def _fill_derived(config: Any) -> None:
    """Fill the fields that default to another field, so the group size and model path are given once."""
    actor = getattr(config, "actor", None)
    gconfig = getattr(config, "gconfig", None)
    if actor is not None and gconfig is not None:
        reconcile_temperature(actor, gconfig)
    if actor is not None:
        if not getattr(config, "tokenizer_path", "x"):
            config.tokenizer_path = actor.path
        if getattr(config, "tokenizer_path", "") in _model_aliases():
            # AReaL and its recipes load it as written (`AutoTokenizer.from_pretrained(config.tokenizer_path)`),
            # which knows folders and hub ids, not the kit's aliases: give it the prepared local folder.
            from areal_lite.utils.model_store import resolve_model_path

            config.tokenizer_path = resolve_model_path(config.tokenizer_path)
        if gconfig is not None and actor.group_size == 1:
            actor.group_size = gconfig.n_samples
        for norm in (actor.reward_norm, actor.adv_norm):
            if norm is not None and norm.group_size == 1:
                norm.group_size = actor.group_size
        for sub in ("sglang", "embedded"):
            server = getattr(config, sub, None)
            if server is not None and not server.model_path:
                server.model_path = actor.path
        vllm = getattr(config, "vllm", None)  # AReaL names vLLM's model field `model`
        if vllm is not None:
            vllm.model = vllm.model or actor.path
            vllm.dtype = vllm.dtype or actor.dtype
    if hasattr(config, "weight_update_dir") and not config.weight_update_dir:
        from areal_lite.utils.weight_dirs import written_version_bytes

        # one version at least: what a run writes at its peak (a new version over the one it prunes)
        need = written_version_bytes(actor.path, actor.dtype) if actor is not None and actor.path else None
        config.weight_update_dir = default_weight_update_dir(
            config.experiment_name, config.trial_name, config.fileroot, need=need
        )
    _fill_section_names(config)
    rollout = getattr(config, "rollout", None)
    if rollout is not None and hasattr(config, "backend"):
        config.backend = server_backend(config)
    reconcile_lora(config)
    if rollout is not None and hasattr(config, "train_dataset"):
        if rollout.consumer_batch_size == 1 and config.train_dataset.batch_size > 1:
            rollout.consumer_batch_size = config.train_dataset.batch_size


def _fill_section_names(config: Any) -> None:
    """AReaL repeats the experiment's names (and fileroot) in each section, by interpolation in its YAMLs; the kit
    gives them once, so a section's empty name, fileroot or tokenizer_path is the experiment's."""
    top = {k: getattr(config, k, None) for k in ("experiment_name", "trial_name", "fileroot", "tokenizer_path")}
    for name in ("rollout", "saver", "evaluator", "recover", "stats_logger", "perf_tracer"):
        section = getattr(config, name, None)
        for key, value in top.items():
            if section is not None and hasattr(section, key) and not getattr(section, key) and value:
                setattr(section, key, value)


def default_weight_update_dir(
    experiment_name: str, trial_name: str, fileroot: str = "runs", need: Optional[int] = None
) -> str:
    """Where disk weight updates go: RAM (`/dev/shm`) when the machine has it, since every step writes a full copy
    of the weights (0.5 GB for SmolLM2 in float32) and the server reads it right back; else under `fileroot`. Also
    under `fileroot` (and a line says so) when /dev/shm is smaller than `need` bytes, one version: a container's is
    often 64 MB (Docker's default). A large but full one is `train`'s to refuse, with what to free.

    The folder belongs to the run, `<exp>/<trial>/weights`, claimed under a lock for as long as this process lives
    (`utils.weight_dirs`): a restarted or resumed run first removes what dead runs left, and a second live run with
    the same names (the English and the Chinese notebook side by side) gets `weights.1` instead of pruning the
    first one's versions. The actor removes its versions when destroyed; the folder goes at exit."""
    import shutil

    from areal_lite.utils.weight_dirs import claim_weight_dir

    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        size = shutil.disk_usage(shm).total
        if need is None or size >= need:
            user = os.environ.get("USER") or str(os.getuid())
            root = os.path.join(shm, f"areal-lite-{user}")
            return claim_weight_dir(os.path.join(root, experiment_name, trial_name, "weights"), sweep_root=root)
        print(f"areal-lite: {shm} holds {size / 2**20:.0f} MiB, less than one weight version ({need / 2**20:.0f} "
              f"MiB): weight versions go under {fileroot}/ instead", flush=True)  # fmt: skip
    return claim_weight_dir(os.path.abspath(os.path.join(fileroot, experiment_name, trial_name, "weights")))
