"""areal-lite: a thin helper package behind notebooks that teach (and run) RL of LLM agents.

Every public name is importable from the package itself, so a notebook cell needs one import line:

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
    "PPOActorConfig",
    "SGLangConfig",
    "EmbeddedServerConfig",
    "vLLMConfig",
    "DatasetConfig",
    "SaverConfig",
    "StatsLoggerConfig",
    "EvaluatorConfig",
    "BaseExperimentConfig",
    "GRPOConfig",
    "load_expr_config",
    "resolve_profile",
    "describe",
)
_export("api.io_struct", "ModelRequest", "ModelResponse", "WeightUpdateMeta", "FinetuneSpec")
_export("models", "prepare_model", "resolve_model_path", "build_tiny_model", "pick_device", "load_tokenizer")
_export(
    "data",
    "load_gsm8k",
    "load_arithmetic",
    "to_messages",
    "build_factbook_corpus",
    "build_factbook_qa",
    "build_factbook_qa_splits",
    "load_search_dataset",
    "load_dataset_from_config",
    "make_dataloader",
    "cycle_dataloader",
)
_export(
    "reward",
    "extract_answer",
    "math_equal",
    "gsm8k_reward_fn",
    "normalize_answer",
    "f1_score",
    "exact_match",
    "areal_gsm8k_reward_fn",
)
_export(
    "tools",
    "parse_search_query",
    "parse_answer",
    "parse_boxed",
    "parse_access_url",
    "format_search_results",
    "call_search_tool",
    "SearchToolError",
)
_export("kit.rag", "launch_rag_server", "RAGServerHandle", "build_app", "build_index")
_export(
    "kit.launch",
    "launch_server",
    "find_free_port",
    "find_free_ports",
    "ServerHandle",
    "ServerLaunchError",
    "choose_backend",
)
_export("engine.sglang_remote", "RemoteSGLangEngine", "EngineError")
_export("engine.vllm_remote", "RemotevLLMEngine")
_export("infra.staleness_manager", "StalenessManager")
_export("infra.workflow_executor", "WorkflowExecutor")
_export(
    "trajectory",
    "concat_padded_tensors",
    "check_trajectory",
    "TrajectoryError",
    "TrajectoryBuilder",
    "Segment",
    "show_trajectory",
    "trajectory_to_text",
    "trajectory_to_html",
)
_export(
    "workflow",
    "RLVRWorkflow",
    "ReflectionWorkflow",
    "SearchAgentWorkflow",
    "MultiTurnFeedbackWorkflow",
    "GroupedWorkflow",
    "chat_prompt_ids",
    "chat_turn_fragments",
    "discounted_returns",
    "PROMPT_TEMPLATE",
)
_export("api.workflow_api", "RolloutWorkflow")
_export("api.reward_api", "AsyncRewardWrapper")
_export("chat", "ChatServer", "ChatSession")
_export("chat_template", "ChatTemplate")
_export("toolcall", "parse_tool_calls")
_export("interactions", "Interaction", "InteractionCache", "interactions_to_batch")
_export("agent", "OpenAIAgentWorkflow")
_export("trainer.ppo.actor", "PPOActor")
_export("utils.functional", "ppo_token_loss")
_export(
    "kit.plot",
    "plot_rewards",
    "plot_response_length",
    "plot_time_breakdown",
    "plot_sync_vs_async",
    "save_png",
    "plot_turns",
)
_export("kit.prepare", "prepare_all")
_export("train", "TrainConfig", "train")
_export("kit.checks", "check_cases")

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'areal_lite' has no attribute {name!r}")
    mod = importlib.import_module(f".{module}", __name__)
    # Bind every export of that module now. Importing a submodule also sets the package attribute of the same
    # name (`areal_lite.train` the module), which would shadow an export called like it (`train` the function).
    for other, where in _EXPORTS.items():
        if where == module:
            globals()[other] = getattr(mod, other)
    return globals()[name]


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
