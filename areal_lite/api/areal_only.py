"""AReaL 1.0.4 config sections the kit accepts but has no machinery for, and the table of what it ignores.

Design decisions
- AReaL's configs load in the kit unchanged: every field of AReaL 1.0.4's config classes exists in the
  kit's, with AReaL's type and default. The sections below (schedulers, clusters, Megatron/Archon engines, trackers)
  belong to machinery the kit does not have; they are AReaL's fields, order and defaults, so a YAML written for
  AReaL passes the kit's strict checker. `tests/test_areal_fields.py` diffs every class against the installed AReaL.
- A field the kit accepts but cannot act on is never a silent no-op: `AREAL_ONLY_FIELDS` says, per `Class.field`,
  either `ignored` (the kit's results do not depend on it: scheduling, logging, parallelism, kernels) -- reported
  once per process when set to a non-default value -- or `refused` (it changes what is trained or sampled, and the
  kit does not implement it) -- a ConfigError when set. Fields the kit implements are in `AREAL_HONOURED`, with how.
  Both tables live here, once, so docs and tests read the same list.
- The check runs in `__post_init__` of each kit config class (`report_areal_only`), so a cell that builds
  `InferenceEngineConfig(backend="sglang:d1", ...)` is checked exactly like a YAML file loaded by `load_expr_config`
  (which constructs the same classes).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

__all__ = [
    "SchedulingSpec",
    "SchedulingStrategy",
    "AgentConfig",
    "FSDPWrapPolicy",
    "FSDPEngineConfig",
    "ArchonFP8Config",
    "ArchonEngineConfig",
    "DistributedDataParallelConfig",
    "FP8EngineConfig",
    "MegatronEngineConfig",
    "WandBConfig",
    "SwanlabConfig",
    "TensorBoardConfig",
    "TrackioConfig",
    "SessionTracerConfig",
    "PerfTracerConfig",
    "MemoryProfilerConfig",
    "NameResolveConfig",
    "ClusterSpecConfig",
    "SchedulerConfig",
    "AREAL_ONLY_FIELDS",
    "AREAL_HONOURED",
    "report_areal_only",
    "note_once",
    "ConfigError",
]


def _f(default: Any = dataclasses.MISSING, help: str = "", choices: tuple | None = None, factory=None):
    """A dataclass field with a one-line help text (and optional allowed values)."""
    meta = {"help": help}
    if choices is not None:
        meta["choices"] = tuple(choices)
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


# --------------------------------------------------------------------------------------------------------------
# AReaL-only sections (AReaL 1.0.4's fields, types and defaults; help shortened from AReaL's)
# --------------------------------------------------------------------------------------------------------------


@dataclass
class SchedulingSpec:
    """SchedulingSpec"""

    cpu: int = _f(8, "Number of CPU cores required per GPU")
    gpu: int = _f(0, "Number of GPU units required")
    mem: int = _f(32, "Amount of memory (GB) required per GPU")
    port_count: int = _f(2, "Number of ports to expose")
    image: str = _f("/storage/openpsi/images/areal-latest.sif", "Docker/Singularity container image to use")
    task_type: str = _f("worker", "Task type (e.g., worker, engine)", choices=("worker", "engine"))
    env_vars: Dict[str, str] = _f(help="Environment variables for the container", factory=dict)
    cmd: Optional[str] = _f(None, "Command to execute inside the container")
    srun_additional_args: str = _f(
        "--unbuffered --mpi=pmi2 -K --chdir $PWD", "Additional arguments to pass to the srun command"
    )
    additional_bash_cmds: Optional[List[str]] = _f(
        None, "Additional bash commands to setup the container before running the torchrun command"
    )
    container_type: str = _f("apptainer", "Type of containers used in slurm", choices=("apptainer", "none"))
    mount: str = _f("/storage:/storage", "Mount path for slurm")
    nodelist: Optional[str] = _f(None, "sbatch/srun's `--nodelist` option for slurm")
    exclude: Optional[str] = _f(None, "sbatch/srun's `--exclude` option for slurm")
    ray_placement_strategy: str = _f(
        "shared", "Which placement strategy to use for Ray scheduling", choices=("shared", "separate", "deferred")
    )


@dataclass
class SchedulingStrategy:
    """SchedulingStrategy"""

    type: str = _f(
        "separation",
        "separation: own workers; colocation: share the target's workers",
        choices=("separation", "colocation"),
    )
    target: Optional[str] = _f(None, "The target role to be colocated with")
    fork: bool = _f(
        True,
        "When True with colocation, the target worker spawns a new process on the same node/GPUs instead of sharing...",
    )


@dataclass
class AgentConfig:
    """Configuration for agent workflows and the experimental agent service controller."""

    agent_cls_path: str = _f("", "Fully-qualified import path for the AgentRunnable implementation")
    admin_api_key: str = _f(
        "areal-admin-key", "Admin API key for the proxy server and agent-service inter-service auth"
    )
    scheduling_spec: Tuple[SchedulingSpec, ...] = _f(
        help="Scheduling spec for agent-service guard workers",
        factory=lambda: (SchedulingSpec(cmd="python -m areal.experimental.agent_service.guard"),),
    )
    mode: str = _f(
        "inline",
        "OpenAI proxy mode: 'inline' (in-process), 'subproc' (subprocess), or 'online' (external user sessions for...",
        choices=("inline", "subproc", "online"),
    )
    tool_call_parser: str = _f("qwen", "Parser for tool calls in model output")
    reasoning_parser: str = _f("qwen3", "Parser for reasoning content (<think> tags)")
    chat_template_type: str = _f(
        "hf", "Chat template type: 'hf' (standard) or 'concat' (multi-turn concatenation)", choices=("hf", "concat")
    )
    engine_max_tokens: Optional[int] = _f(None, "Maximum total tokens for the engine (prompt + completion)")
    turn_discount: float = _f(1.0, "Discount factor for multi-turn reward propagation")
    export_style: str = _f(
        "individual",
        "Export style: 'individual' (all interactions) or 'concat' (leaf nodes only)",
        choices=("individual", "concat"),
    )
    subproc_max_workers: int = _f(4, "Maximum number of worker processes for subprocess mode execution pool")
    session_timeout_seconds: int = _f(3600, "Session timeout in seconds")
    set_reward_finish_timeout: float = _f(
        0.0, "Timeout in seconds to wait for additional reward updates before finalizing a session"
    )


@dataclass
class FSDPWrapPolicy:
    """Policy configuration for FSDP model layer wrapping (None: the decoder layers transformers names)."""

    transformer_layer_cls_to_wrap: Optional[List[str]] = _f(None, "A list of transformer layer names for FSDP to wrap")


@dataclass
class FSDPEngineConfig:
    """Configuration for Fully Sharded Data Parallel (FSDP) training backend."""

    wrap_policy: Optional[FSDPWrapPolicy] = _f(None, "FSDP wrap policy, specifying model layers to wrap")
    offload_params: bool = _f(False, "Whether to offload FSDP parameters to CPU")
    memory_efficient_load: bool = _f(False, "Enable memory-efficient model loading")
    per_layer_optim_step: bool = _f(
        False, "Run Adam step on GPU by streaming optimizer states layer-by-layer with async prefetching, instead of..."
    )
    optim_step_prefetch_layers: int = _f(1, "Number of layers to prefetch during per-layer optim step")
    shard_vision_across_sp: bool = _f(False, "Shard vision encoder across SP ranks by image")


@dataclass
class ArchonFP8Config:
    """Archon FP8 training configuration."""

    mode: str = _f("disabled", "FP8 precision mode", choices=("disabled", "blockwise"))
    exclude_modules: List[str] = _f(
        help="FQN substrings of nn.Linear modules to keep in BF16 (not converted to FP8)",
        factory=lambda: ["output", "router", "score"],
    )
    include_experts: bool = _f(False, "Apply FP8 to MoE expert computation")
    use_triton: bool = _f(
        True, "Use Triton GEMM kernel for FP8 blockwise matmuls instead of cuBLAS. Currently must be True: torchao's..."
    )


@dataclass
class ArchonEngineConfig:
    """Configuration for Archon Engine training backend."""

    attn_type: str = _f("varlen", "Attention backend type", choices=("varlen", "sdpa", "tree"))
    offload_params: bool = _f(False, "Whether to offload FSDP parameters to CPU")
    enable_compile: bool = _f(False, "Enable torch.compile for TransformerBlocks")
    ac_mode: str = _f(
        "selective", "Activation checkpointing mode", choices=("none", "full", "selective", "memory_budget")
    )
    selective_ac_option: str = _f(
        "op", "Selective AC option: 'op' for op-level, or integer string (e.g., '2') for every Nth layer"
    )
    ac_memory_budget: float = _f(0.5, "Memory budget for 'memory_budget' AC mode")
    ac_preserve_rng_state: bool = _f(False, "Preserve RNG state during checkpointing for deterministic output")
    ac_debug: bool = _f(False, "(Testing only) Capture AC debug information")
    pp_schedule: str = _f(
        "Interleaved1F1B",
        "Pipeline parallel schedule type",
        choices=("1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"),
    )
    pp_layers_per_stage: Optional[int] = _f(None, "Number of transformer layers per (virtual) pipeline stage")
    pp_first_stage_less_layers: int = _f(1, "Number of layers to reduce in the first pipeline stage")
    pp_last_stage_less_layers: int = _f(1, "Number of layers to reduce in the last pipeline stage")
    reshard_after_forward_policy: str = _f(
        "default", "FSDP reshard policy after forward pass", choices=("default", "always", "never")
    )
    fp8_config: ArchonFP8Config = _f(help="FP8 training configuration", factory=ArchonFP8Config)
    use_deterministic_algorithms: bool = _f(False, "Enable deterministic algorithms for training reproducibility")
    moe_router_dtype: Optional[str] = _f(
        "fp32", "Data type for MoE router gate GEMM computation", choices=("fp32", None)
    )


@dataclass
class DistributedDataParallelConfig:
    """Configuration for Megatron's DistributedDataParallel."""

    grad_reduce_in_fp32: bool = _f(True, "Megatron-Core DDP option `grad_reduce_in_fp32` (AReaL's Megatron engine)")
    overlap_grad_reduce: bool = _f(False, "Megatron-Core DDP option `overlap_grad_reduce` (AReaL's Megatron engine)")
    overlap_param_gather: bool = _f(False, "Megatron-Core DDP option `overlap_param_gather` (AReaL's Megatron engine)")
    align_param_gather: bool = _f(False, "Megatron-Core DDP option `align_param_gather` (AReaL's Megatron engine)")
    use_distributed_optimizer: bool = _f(
        True, "Megatron-Core DDP option `use_distributed_optimizer` (AReaL's Megatron engine)"
    )
    check_for_nan_in_grad: bool = _f(
        False, "Megatron-Core DDP option `check_for_nan_in_grad` (AReaL's Megatron engine)"
    )
    bucket_size: Optional[int] = _f(None, "Megatron-Core DDP option `bucket_size` (AReaL's Megatron engine)")
    average_in_collective: bool = _f(
        False, "Megatron-Core DDP option `average_in_collective` (AReaL's Megatron engine)"
    )
    fp8_param_gather: bool = _f(False, "Megatron-Core DDP option `fp8_param_gather` (AReaL's Megatron engine)")


@dataclass
class FP8EngineConfig:
    """Configuration for FP8 (8-bit floating point) training."""

    mode: str = _f("e4m3", "FP8 precision mode")
    recipe: str = _f("delayed", "FP8 scaling recipe")
    param: bool = _f(False, "Keep parameters in FP8 precision to save memory")
    margin: int = _f(0, "Margin for FP8 scaling factor computation")
    amax_history_len: int = _f(1, "Length of amax history window for scaling factor computation")
    amax_compute_algo: str = _f("most_recent", "Algorithm for choosing amax value")
    wgrad: bool = _f(True, "When False, override FP8 config and compute weight gradients in higher precision")
    dot_product_attention: bool = _f(False, "Use FP8 implementation of Dot Product Attention")
    multi_head_attention: bool = _f(False, "Use FP8 implementation of Multi Head Attention")
    tp_only_amax_red: bool = _f(False, "Reduce FP8 AMAX only in TP or TP-CP domain")
    first_last_layers_bf16: bool = _f(False, "Retain first and last N TransformerBlocks in BF16 instead of FP8")
    num_layers_at_start_in_bf16: int = _f(
        1, "Number of layers at start to keep in BF16 when first_last_layers_bf16 is True"
    )
    num_layers_at_end_in_bf16: int = _f(
        1, "Number of layers at end to keep in BF16 when first_last_layers_bf16 is True"
    )
    direct_convert: bool = _f(True, "Whether to use direct FP8 conversion during weight updates and save/load")


@dataclass
class MegatronEngineConfig:
    """Configuration for Megatron-LM training framework."""

    wrap_with_ddp: bool = _f(True, "Megatron engine option `wrap_with_ddp` (AReaL's Megatron engine)")
    use_torch_fsdp2: bool = _f(False, "Megatron engine option `use_torch_fsdp2` (AReaL's Megatron engine)")
    use_custom_fsdp: bool = _f(False, "Megatron engine option `use_custom_fsdp` (AReaL's Megatron engine)")
    ddp: DistributedDataParallelConfig = _f(
        help="Megatron engine option `ddp` (AReaL's Megatron engine)", factory=DistributedDataParallelConfig
    )
    virtual_pipeline_parallel_size: int = _f(1, "Virtual pipeline parallel size for Megatron interleaved schedule")
    overlap_param_gather_with_optimizer_step: bool = _f(
        False, "Megatron engine option `overlap_param_gather_with_optimizer_step` (AReaL's Megatron engine)"
    )
    use_precision_aware_optimizer: bool = _f(False, "Enable precision-aware optimizer for Megatron")
    main_grads_dtype: str = _f("float32", "Megatron engine option `main_grads_dtype` (AReaL's Megatron engine)")
    main_params_dtype: str = _f("float32", "Megatron engine option `main_params_dtype` (AReaL's Megatron engine)")
    exp_avg_dtype: str = _f("float32", "Megatron engine option `exp_avg_dtype` (AReaL's Megatron engine)")
    exp_avg_sq_dtype: str = _f("float32", "Megatron engine option `exp_avg_sq_dtype` (AReaL's Megatron engine)")
    async_save: bool = _f(
        False,
        "If True, Megatron checkpoint saves run in background processes and save_checkpoint() returns immediately...",
    )
    use_checkpoint_opt_param_scheduler: bool = _f(
        True, "Megatron engine option `use_checkpoint_opt_param_scheduler` (AReaL's Megatron engine)"
    )
    use_deterministic_algorithms: bool = _f(
        False, "Megatron engine option `use_deterministic_algorithms` (AReaL's Megatron engine)"
    )
    recompute_granularity: Optional[str] = _f(
        "full", "Megatron engine option `recompute_granularity` (AReaL's Megatron engine)"
    )
    recompute_method: Optional[str] = _f(
        "uniform", "Megatron engine option `recompute_method` (AReaL's Megatron engine)"
    )
    recompute_num_layers: Optional[int] = _f(
        1, "Megatron engine option `recompute_num_layers` (AReaL's Megatron engine)"
    )
    distribute_saved_activations: Optional[bool] = _f(
        None, "Megatron engine option `distribute_saved_activations` (AReaL's Megatron engine)"
    )
    recompute_modules: Optional[List[str]] = _f(
        None, "Megatron engine option `recompute_modules` (AReaL's Megatron engine)"
    )
    moe_router_dtype: Optional[str] = _f("fp32", "Megatron engine option `moe_router_dtype` (AReaL's Megatron engine)")
    moe_shared_expert_overlap: bool = _f(
        False, "Enable overlapping between shared expert computations and dispatcher communications"
    )
    moe_enable_deepep: bool = _f(False, "Megatron engine option `moe_enable_deepep` (AReaL's Megatron engine)")
    moe_token_dispatcher_type: str = _f("alltoall", "Type of token dispatcher")
    moe_permute_fusion: bool = _f(False, "Fuse token rearrangement ops during token dispatching")
    fp8_config: Optional[FP8EngineConfig] = _f(None, "Megatron engine option `fp8_config` (AReaL's Megatron engine)")
    bridge_type: str = _f("mbridge", "Bridge backend for MegatronEngine", choices=("mbridge", "megatron-bridge"))
    use_mbridge_save: bool = _f(False, "Use mbridge's save method to save gpu memory when saving weights")
    use_bridge_for_update_weights: bool = _f(
        False,
        "When True and bridge_type='megatron-bridge', delegate live weight sync to bridge.export_hf_weights instead...",
    )


@dataclass
class WandBConfig:
    """Configuration for Weights & Biases experiment tracking."""

    mode: str = _f("disabled", "Tracking mode", choices=("online", "offline", "disabled", "shared"))
    wandb_base_url: str = _f("", "wandb.init `wandb_base_url`")
    wandb_api_key: str = _f("", "wandb.init `wandb_api_key`")
    entity: Optional[str] = _f(None, "wandb.init `entity`")
    project: Optional[str] = _f(None, "wandb.init `project`")
    name: Optional[str] = _f(None, "wandb.init `name`")
    job_type: Optional[str] = _f(None, "wandb.init `job_type`")
    group: Optional[str] = _f(None, "wandb.init `group`")
    notes: Optional[str] = _f(None, "wandb.init `notes`")
    tags: Optional[List[str]] = _f(None, "wandb.init `tags`")
    config: Optional[Dict[str, Any]] = _f(None, "wandb.init `config`")
    id_suffix: Optional[str] = _f("train", "wandb.init `id_suffix`")


@dataclass
class SwanlabConfig:
    """Configuration for SwanLab experiment tracking and monitoring."""

    project: Optional[str] = _f(None, "swanlab.init `project`")
    name: Optional[str] = _f(None, "swanlab.init `name`")
    config: Optional[Dict[str, Any]] = _f(None, "swanlab.init `config`")
    logdir: Optional[str] = _f(None, "swanlab.init `logdir`")
    mode: str = _f("disabled", "Tracking mode", choices=("cloud", "local", "disabled", "offline"))
    api_key: Optional[str] = _f(None, "swanlab.init `api_key`")


@dataclass
class TensorBoardConfig:
    """Configuration for TensorBoard logging and visualization."""

    path: Optional[str] = _f(None, "folder of the TensorBoard event files; None disables TensorBoard")

    def __bool__(self) -> bool:
        # AReaL's rule: TensorBoard is on exactly when a path is set (`if config.stats_logger.tensorboard:` reads so)
        return self.path is not None


@dataclass
class TrackioConfig:
    """Configuration for Trackio experiment tracking (Hugging Face)."""

    mode: str = _f("disabled", "trackio.init `mode`")
    project: Optional[str] = _f(None, "trackio.init `project`")
    name: Optional[str] = _f(None, "trackio.init `name`")
    space_id: Optional[str] = _f(None, "trackio.init `space_id`")


@dataclass
class SessionTracerConfig:
    """Configuration for per-session lifecycle tracing."""

    enabled: bool = _f(False, "Enable per-session lifecycle tracing alongside perf events")
    flush_threshold: int = _f(256, "Flush session trace records once this many entries are ready")


@dataclass
class PerfTracerConfig:
    """Configuration for perf tracer emission."""

    experiment_name: str = _f("", "experiment name; empty: the experiment's (AReaL: required)")
    trial_name: str = _f("", "trial name; empty: the experiment's (AReaL: required)")
    fileroot: str = _f("", "root folder; empty: the experiment's (AReaL: required)")
    enabled: bool = _f(False, "Explicitly enable or disable perf tracing")
    save_interval: int = _f(1, "Flush trace events to disk every N calls to save(step=...)")
    profile_steps: Optional[List[int]] = _f(None, "List of step numbers at which to capture detailed profiling traces")
    session_tracer: Optional[SessionTracerConfig] = _f(None, "Session tracing configuration")


@dataclass
class MemoryProfilerConfig:
    """CUDA memory snapshot profiling configuration."""

    profile_steps: List[int] = _f(help="List of global steps to capture memory snapshots", factory=lambda: [0, 1])
    max_entries: int = _f(100000, "Max entries for memory history ring buffer")


@dataclass
class NameResolveConfig:
    """Configuration for distributed name resolution and service discovery."""

    type: str = _f("nfs", "Type of the distributed KV store for name resolving", choices=("nfs", "etcd3", "ray"))
    nfs_record_root: str = _f("/tmp/areal/name_resolve", "Record root for NFS name resolving")
    etcd3_addr: str = _f("localhost:2379", "Address of the ETCD3 server")
    ray_actor_name: str = _f("ray_kv_store", "Name of the distributed Ray KV store")


@dataclass
class ClusterSpecConfig:
    """Configuration for cluster specification and distributed computing setup."""

    name_resolve: NameResolveConfig = _f(help="Name resolving configuration", factory=NameResolveConfig)
    cluster_name: str = _f("local", "Name of the cluster")
    fileroot: str = _f("/tmp/areal/", "Root for logs and checkpoints")
    n_nodes: int = _f(32, "The size of the cluster")
    n_gpus_per_node: int = _f(8, "Number of GPUs per node (physical)")


@dataclass
class SchedulerConfig:
    """Configuration for worker scheduling. Used in the single-controller mode. Experimental."""

    type: Optional[str] = _f(None, "AReaL scheduler setting `type`")
    endpoint: str = _f("http://localhost:8081", "AReaL scheduler setting `endpoint`")
    deploy_mode: str = _f("separation", "AReaL scheduler setting `deploy_mode`")
    functioncall_service_domain: str = _f(
        "http://localhost:8080", "AReaL scheduler setting `functioncall_service_domain`"
    )
    reward_functioncall_config: Dict[str, Any] = _f(
        help="AReaL scheduler setting `reward_functioncall_config`", factory=dict
    )
    reward_model_path: str = _f("", "AReaL scheduler setting `reward_model_path`")
    reward_model_service_url: str = _f(
        "http://localhost:30000/classify", "AReaL scheduler setting `reward_model_service_url`"
    )


# --------------------------------------------------------------------------------------------------------------
# What the kit does with AReaL's fields
# --------------------------------------------------------------------------------------------------------------

IGNORED, REFUSED = "ignored", "refused"
_NO_SCHEDULER = "the kit has no scheduler or controller: it runs in this process and one server"
_NO_ENGINE = "the kit trains with its own single-process engine (no Megatron/Archon/FSDP sharding)"
_NO_SERVICE = "the kit has no inference-service gateway or agent service"
_TRACKERS = "the kit logs to stats.jsonl (and TensorBoard/W&B); no other tracker"


def _same(reason: str, kind: str, *keys: str) -> Dict[str, Tuple[str, str]]:
    return {key: (kind, reason) for key in keys}


# `Class.field` -> (ignored | refused, why). Ignored: reported once when set to a non-default value (results do not
# depend on it). Refused: a ConfigError when set to a non-default value (results would depend on it).
AREAL_ONLY_FIELDS: Dict[str, Tuple[str, str]] = {
    **_same(
        _NO_SCHEDULER,
        IGNORED,
        "BaseExperimentConfig.cluster",
        "BaseExperimentConfig.scheduler",
        "InferenceEngineConfig.scheduling_spec",
        "InferenceEngineConfig.scheduling_strategy",
        "InferenceEngineConfig._version",
        "TrainEngineConfig.scheduling_spec",
        "TrainEngineConfig.scheduling_strategy",
        "TrainEngineConfig._version",
        "TrainEngineConfig.admin_api_key",
        "TrainEngineConfig.log_level",
        "TrainEngineConfig.request_timeout",
        "TrainEngineConfig.setup_timeout",
        "DatasetConfig.scheduling_spec",
        "DatasetConfig.num_dataset_workers",
        "DatasetConfig.setup_timeout",
    ),  # fmt: skip
    "BaseExperimentConfig.allocation_mode": (IGNORED, "deprecated in AReaL; the kit reads rollout.backend"),
    "BaseExperimentConfig.enable_offload": (IGNORED, "no torch_memory_saver offload in the kit"),
    "BaseExperimentConfig.perf_tracer": (IGNORED, "no perf tracer in the kit"),
    "BaseExperimentConfig.memory_profiler": (IGNORED, "no memory profiler in the kit"),
    "BaseExperimentConfig.total_train_n_seqs": (REFUSED, "the kit stops by total_train_steps or epochs only"),
    "PPOConfig.critic": (REFUSED, "the kit trains GRPO without a critic (value 0)"),
    "PPOConfig.teacher": (REFUSED, "the kit has no on-policy distillation"),
    "PPOConfig.dynamic_bs": (REFUSED, "the kit's prepare_batch always returns consumer_batch_size episodes"),
    **_same(
        _NO_SERVICE,
        IGNORED,
        "InferenceEngineConfig.agent",
        "InferenceEngineConfig.model",
        "InferenceEngineConfig.routing_strategy",
        "InferenceEngineConfig.poll_interval",
        "InferenceEngineConfig.admin_api_key",
        "InferenceEngineConfig.api_url",
        "InferenceEngineConfig.provider_api_key",
    ),  # fmt: skip
    "InferenceEngineConfig.check_trajectory_format": (
        IGNORED,
        "not yet: the kit's executor checks dict/tensors/2-D ids",
    ),
    "InferenceEngineConfig.dump_to_file": (IGNORED, "not yet: the kit writes per-step statistics, not episodes"),
    "InferenceEngineConfig.enable_rollout_tracing": (IGNORED, "the kit's executor has its own `explain()`"),
    "InferenceEngineConfig.pause_grace_period": (IGNORED, "the kit's pause waits for aborted requests itself"),
    "InferenceEngineConfig.return_routed_experts": (IGNORED, "no MoE routing replay in the kit"),
    **_same(
        _NO_ENGINE,
        IGNORED,
        "TrainEngineConfig.fsdp",
        "TrainEngineConfig.archon",
        "TrainEngineConfig.megatron",
        "TrainEngineConfig.offload",
        "TrainEngineConfig.grad_reduce_dtype",
        "TrainEngineConfig.optimizer_dtype",
        "TrainEngineConfig.pad_to_maximum",
        "TrainEngineConfig.use_kernels",
        "TrainEngineConfig.attn_impl",
        "TrainEngineConfig.enable_tree_training",
        "MicroBatchSpec.granularity",
        "MicroBatchSpec.n_mbs_divisor",
        "MicroBatchSpec.packing_algorithm",
        "OptimizerConfig.initial_loss_scale",
        "OptimizerConfig.min_loss_scale",
        "OptimizerConfig.loss_scale_window",
        "OptimizerConfig.hysteresis",
    ),  # fmt: skip
    "TrainEngineConfig.weight_update_mode": (IGNORED, "the kit always updates weights through files (disk)"),
    "TrainEngineConfig.init_from_scratch": (REFUSED, "the kit always loads the pretrained weights"),
    "TrainEngineConfig.is_critic": (REFUSED, "the kit has no critic"),
    "PPOActorConfig.m2_threshold": (REFUSED, "no M2PO in the kit"),
    "PPOActorConfig.overlong_reward_penalty": (REFUSED, "no DAPO overlong penalty in the kit"),
    "PPOActorConfig.overlong_tokens": (IGNORED, "used only by the overlong penalty"),
    "PPOActorConfig.overlong_penalty_factor": (IGNORED, "used only by the overlong penalty"),
    "PPOActorConfig.max_new_tokens": (IGNORED, "used only by the overlong penalty"),
    "PPOActorConfig.mask_no_eos_with_zero": (REFUSED, "the kit trains on truncated answers too"),
    "PPOActorConfig.discount": (REFUSED, "the kit's GRPO advantages use discount = gae_lambda = 1"),
    "PPOActorConfig.gae_lambda": (REFUSED, "the kit's GRPO advantages use discount = gae_lambda = 1"),
    "PPOActorConfig.use_sapo_loss": (REFUSED, "no SAPO loss in the kit"),
    "PPOActorConfig.sapo_tau_pos": (IGNORED, "used only by the SAPO loss"),
    "PPOActorConfig.sapo_tau_neg": (IGNORED, "used only by the SAPO loss"),
    "PPOActorConfig.importance_sampling_level": (REFUSED, "the kit's ratios are per token"),
    "PPOActorConfig.prox_logp_method": (REFUSED, "the kit recomputes the proximal log-probs"),
    "PPOActorConfig.log_agent_stats": (IGNORED, "the kit's trainer logs its own statistics"),
    "PPOActorConfig.log_agent_stats_keys": (IGNORED, "the kit's trainer logs its own statistics"),
    "StatsLoggerConfig.swanlab": (IGNORED, _TRACKERS),
    "StatsLoggerConfig.trackio": (IGNORED, _TRACKERS),
    **_same(
        "the kit's trainer names the W&B run itself; only wandb.mode is read",
        IGNORED,
        "WandBConfig.wandb_base_url",
        "WandBConfig.wandb_api_key",
        "WandBConfig.entity",
        "WandBConfig.project",
        "WandBConfig.name",
        "WandBConfig.job_type",
        "WandBConfig.group",
        "WandBConfig.notes",
        "WandBConfig.tags",
        "WandBConfig.config",
        "WandBConfig.id_suffix",
    ),  # fmt: skip
    "TensorBoardConfig.path": (IGNORED, "a path turns TensorBoard on; the kit writes it under its run folder"),
    "SaverConfig.freq_epochs": (IGNORED, "the kit saves every saver.freq_steps steps only"),
    "SaverConfig.freq_secs": (IGNORED, "the kit saves every saver.freq_steps steps only"),
    "SaverConfig.mode": (IGNORED, "the kit saves synchronously"),
    "EvaluatorConfig.freq_epochs": (IGNORED, "the kit evaluates every evaluator.freq_steps steps only"),
    "EvaluatorConfig.freq_secs": (IGNORED, "the kit evaluates every evaluator.freq_steps steps only"),
    "EvaluatorConfig.eval_before_train": (IGNORED, "the kit's trainer always evaluates before the first step"),
    "DatasetConfig.pin_memory": (IGNORED, "the kit's loader yields rows, not tensors"),
    "DatasetConfig.num_workers": (IGNORED, "the kit's loader runs in the trainer's process"),
    "DatasetConfig.dataset_kwargs": (IGNORED, "the kit's datasets take no extra arguments"),
    **_same(
        "not a flag of the SGLang release the kit pins",
        IGNORED,
        "SGLangConfig.enable_ep_moe",
        "SGLangConfig.enable_nan_detection",
        "SGLangConfig.enable_multithread_load",
        "SGLangConfig.torchao_config",
    ),  # fmt: skip
    "vLLMConfig.disable_sliding_window": (IGNORED, "the kit leaves sliding windows to vLLM's default"),
    "vLLMConfig.distributed_executor_backend": (IGNORED, "the kit starts one vLLM process"),
    "vLLMConfig.worker_extension_cls": (IGNORED, "the kit loads its own worker extension"),
}

# AReaL fields the kit acts on beyond its own (the ones it always had are not listed): `Class.field` -> how.
AREAL_HONOURED: Dict[str, str] = {
    "InferenceEngineConfig.backend": "its prefix (sglang, vllm, or the kit's embedded) picks the server",
    "InferenceEngineConfig.tokenizer_path": "filled from the experiment's tokenizer_path when empty",
    "InferenceEngineConfig.experiment_name": "filled from the experiment when empty",
    "InferenceEngineConfig.trial_name": "filled from the experiment when empty",
    "InferenceEngineConfig.fileroot": "filled from the experiment when empty",
    "TrainEngineConfig.backend": "its prefix must be fsdp (the kit's engine is FSDP-style)",
    "PPOActorConfig.rejection_sampling": "token/mask/ratio with an upper bound is the kit's behav_imp_weight_cap",
    "TrainEngineConfig.disable_dropout": "sets every dropout probability to 0 before training",
    "TrainEngineConfig.use_lora": "wraps the actor with a peft LoRA adapter; only the adapter trains and is synced",
    "TrainEngineConfig.lora_rank": "the adapter's rank r",
    "TrainEngineConfig.lora_alpha": "the adapter's alpha (its update is scaled by alpha / r)",
    "TrainEngineConfig.target_modules": "the modules adapted; empty or [all-linear]: every decoder linear layer",
    "TrainEngineConfig.peft_type": "must be lora (AReaL's only PEFT method)",
    "InferenceEngineConfig.use_lora": "requests name the adapter <gconfig.lora_name>-v<version>; must equal "
    "actor.use_lora",
    "InferenceEngineConfig.lora_name": "the adapter name when gconfig.lora_name is empty",
    "GenerationHyperparameters.lora_name": "the adapter name requests and weight updates use (AReaL's)",
    "StatsLoggerConfig.wandb": "wandb.mode is the kit's stats_logger.wandb_mode",
    "StatsLoggerConfig.tensorboard": "TensorBoard is on when tensorboard.path is set",
    "SGLangConfig.*": "a field left at AReaL's default is not passed; any other value is passed as its flag",
    "vLLMConfig.*": "the fields the kit's launcher maps, plus any other set to a non-default value, as flags",
    "vLLMConfig.enable_lora": "passed as --enable-lora; a LoRA run on vLLM needs it (the config loader says so)",
    "vLLMConfig.max_lora_rank": "passed with enable_lora; at least actor.lora_rank, one of the ranks vLLM accepts",
    "vLLMConfig.max_loras": "passed with enable_lora",
    "vLLMConfig.lora_modules": "passed with enable_lora, as --lora-modules (name=path each)",
}


class ConfigError(ValueError):
    """A configuration problem, phrased so the user can fix it without reading our code (re-exported by
    `areal_lite.api.cli_args`, where users import it)."""


_reported: set = set()


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _plain(v: Any) -> Any:
    """`v` with tuples as lists and dataclasses as dicts: OmegaConf turns a tuple default into a list, which is the
    same setting and must not count as "changed"."""
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: _plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def report_areal_only(obj: Any, owner: Optional[str] = None) -> None:
    """Check `obj`'s AReaL-only fields against `AREAL_ONLY_FIELDS`: one line per ignored field set to a non-default
    value (once per process), a ValueError for a refused one. `owner`: the class name the table uses (default:
    the class's own, or the first base class listed there)."""
    names = [owner] if owner else [c.__name__ for c in type(obj).__mro__]
    for f in dataclasses.fields(obj):
        entry, key = None, None
        for name in names:
            key = f"{name}.{f.name}"
            entry = AREAL_ONLY_FIELDS.get(key)
            if entry is not None:
                break
        if entry is None or _plain(getattr(obj, f.name)) == _plain(_default_of(f)):
            continue
        kind, why = entry
        if kind == REFUSED:
            raise ConfigError(f"`{key}` = {getattr(obj, f.name)!r} is not supported by the kit: {why}")
        note_once(key, f"has no effect in the kit: {why}")


def note_once(key: str, message: str) -> None:
    """Print `areal-lite: `key` message` the first time this process meets `key` (a config is often built many
    times: once per notebook cell run, once per profile)."""
    if key not in _reported:
        _reported.add(key)
        print(f"areal-lite: `{key}` {message}")
