"""areal-lite: a thin helper package behind notebooks that teach (and run) RL of LLM agents.

The names the notebooks use are importable from the package itself, so a notebook cell needs one import line:

    from areal_lite import GRPOConfig, load_expr_config, launch_server, RemoteSGLangEngine

Names are resolved lazily (PEP 562): `import areal_lite` is instant, and importing a name loads only its module
(torch and transformers are imported by the modules that need them, when you first use one).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it (one module per notebook step)
_EXPORTS: dict[str, str] = {}


def _export(module: str, *names: str) -> None:
    for name in names:
        _EXPORTS[name] = module


_export(
    "api.cli_args",
    "ConfigError",
    "GenerationHyperparameters",
    "InferenceEngineConfig",
    "OptimizerConfig",
    "MicroBatchSpec",
    "NormConfig",
    "RejectionSamplingConfig",
    "PPOActorConfig",
    "SGLangConfig",
    "EmbeddedServerConfig",
    "vLLMConfig",
    "DatasetConfig",
    "SaverConfig",
    "StatsLoggerConfig",
    "EvaluatorConfig",
    "RecoverConfig",
    "BaseExperimentConfig",
    "GRPOConfig",
    "load_expr_config",
    "resolve_profile",
    "describe",
)
_export("api.io_struct", "ModelRequest", "ModelResponse", "WeightUpdateMeta", "FinetuneSpec")
_export("api.workflow_api", "RolloutWorkflow")
_export("api.reward_api", "AsyncRewardWrapper")
_export("api.engine_api", "TrainEngine", "InferenceEngine")
_export("dataset.arithmetic", "load_arithmetic", "load_products")
_export("dataset.common", "to_messages")
_export(
    "dataset.factbook",
    "build_factbook_corpus",
    "build_factbook_qa",
    "build_factbook_qa_splits",
    "load_search_dataset",
)
_export("dataset.gsm8k", "load_gsm8k")
_export("dataset.loader", "load_dataset_from_config")
_export("engine.fsdp_engine", "FSDPPPOActor")
_export("engine.sglang_remote", "RemoteSGLangEngine")
_export("engine.vllm_remote", "RemotevLLMEngine")
_export("experimental.openai.cache", "Interaction", "InteractionCache", "interactions_to_batch")
_export("experimental.openai.types", "InteractionWithTokenLogpReward")
_export("experimental.openai.client", "concat_prompt_token_ids_with_parent")
_export("experimental.openai.chat_template", "ChatTemplate")
_export("experimental.openai.proxy.server", "ChatServer", "ChatSession")
_export("experimental.openai.proxy.workflow", "OpenAIAgentWorkflow")
_export("experimental.openai.tool_call_parser", "parse_tool_calls")
_export("experimental.workflow.environment", "EnvironmentWorkflow", "inspect_environment")
_export("infra.remote_inf_engine", "EngineError")
_export("infra.staleness_manager", "StalenessManager", "VersionCounter")
_export("infra.workflow_executor", "WorkflowExecutor")
_export("kit.notebook.carry", "run_cells_defining")
_export("kit.notebook.checks", "check_cases", "request_sampling")
_export("kit.server.launch", "launch_server", "ServerHandle", "choose_backend")
_export(
    "kit.notebook.plot",
    "plot_rewards",
    "plot_response_length",
    "plot_time_breakdown",
    "plot_sync_vs_async",
    "save_png",
    "plot_turns",
)
_export("kit.notebook.prepare", "prepare_all")
_export("utils.network", "find_free_port", "find_free_ports")
_export("kit.server.procs", "ServerLaunchError")
_export("kit.rag", "launch_rag_server", "RAGServerHandle", "build_app", "build_index")
_export("kit.trainer.train", "TrainConfig", "train")
_export("kit.notebook.viewer", "show_trajectory", "trajectory_to_text", "trajectory_to_html")
_export("reward", "MathVerifyWorker", "get_math_verify_worker")
_export("reward.gsm8k", "gsm8k_reward_fn")
_export("reward.geometry3k", "geometry3k_reward_fn")
_export("reward.clevr_count_70k", "clevr_count_70k_reward_fn")
_export("reward.arithmetic", "arithmetic_reward_fn")
_export("reward.math_answer", "extract_answer", "math_equal", "answer_reward")
_export("reward.search_qa", "normalize_answer", "f1_score", "exact_match")
_export("reward.judge", "GroupJudge", "pairwise_agreement")
_export(
    "utils.data",
    "cycle_dataloader",
    "concat_padded_tensors",
    "Normalization",
    "pack_tensor_dict",
    "pad_sequences_to_tensors",
    "split_padded_tensor_dict_into_mb_list",
    "unpack_sequence",
    "reorder_list",
    "pad_and_stack_tensors_along_first_dim",
    "tensor_container_to",
    "MicroBatchList",
)
_export("utils.dataloader", "make_dataloader")
_export("utils.device", "pick_device")
_export("utils.machine", "describe_line")
_export("utils.functional", "discounted_returns", "ppo_token_loss")
_export("utils.functional", "ppo_actor_loss_fn", "sapo_loss_fn", "apply_rejection_sampling")
_export("utils.hf_utils", "chat_prompt_ids", "chat_turn_fragments", "load_hf_tokenizer", "apply_chat_template")
_export("utils.model_store", "prepare_model", "resolve_model_path", "build_tiny_model", "load_tokenizer")
_export(
    "utils.search_tool",
    "parse_search_query",
    "parse_answer",
    "parse_boxed",
    "parse_access_url",
    "format_search_results",
    "call_search_tool",
    "SearchToolError",
)
_export("utils.trajectory", "check_trajectory", "TrajectoryError", "TrajectoryBuilder", "Segment")
_export("workflow.grouped", "GroupedWorkflow")
_export("workflow.multi_turn", "MultiTurnWorkflow")
_export("workflow.multi_turn_feedback", "MultiTurnFeedbackWorkflow")
_export("workflow.reflection", "ReflectionWorkflow")
_export("workflow.rlvr", "RLVRWorkflow")
_export("workflow.search_agent", "SearchAgentWorkflow", "PROMPT_TEMPLATE")

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'areal_lite' has no attribute {name!r}")
    mod = importlib.import_module(f".{module}", __name__)
    # Bind every export of that module now. Importing a submodule also sets the package attribute of the same
    # name (`areal_lite.kit.trainer.train` the module), which would shadow an export called like it (`train` the
    # function).
    for other, where in _EXPORTS.items():
        if where == module:
            globals()[other] = getattr(mod, other)
    return globals()[name]


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
