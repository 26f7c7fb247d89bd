"""Where the kit meets AReaL 1.0.4: which names move to AReaL, which are kit-only, and the one boundary call.

A notebook cell's imports convert to AReaL 1.0.4 by one rule: the package is laid out as AReaL's, so
`from areal_lite.<path> import <name>` becomes `from areal.<path> import <name>`, except for the kit-only names
listed here. The rule rewrites imports and nothing else; the few calls AReaL takes differently are named at their
cells in the to-AReaL notebook (08_to_areal), which runs the converted cells it can. This module says which is which:
- `AREAL_NAMES`: every kit name with an AReaL 1.0.4 twin (same name, signature, defaults, return type) and its AReaL
  module; `tests/test_areal_api.py` checks each against the installed AReaL, `tests/test_package.py` the paths.
- `KIT_ONLY`: the kit's conveniences AReaL does not have, each with what an AReaL experiment uses instead.
- `to_areal_cell(source)`: the rule applied to a cell's imports (kit-only names stay imported from the kit).
- `register_with_areal()`: AReaL's engine accepts only `areal.api.RolloutWorkflow` instances, and the kit never
  imports `areal` (it pulls in ray), so this registers the kit's workflow base as a virtual subclass of AReaL's.
- `export_areal_experiment`: notebook cells as a runnable AReaL script, config and data (`kit.areal.run` trains it).

Where AReaL 1.0.4 itself behaves badly, the kit keeps its fix (`BETTER_THAN_AREAL` lists each, with what AReaL
does) and a notebook that meets one says so at that cell.
"""

from __future__ import annotations

import ast
from typing import Dict, Iterable, List

__all__ = [
    "AREAL_VERSION",
    "AREAL_NAMES",
    "KIT_ONLY",
    "BETTER_THAN_AREAL",
    "areal_import_lines",
    "areal_object",
    "to_areal_cell",
    "register_with_areal",
    "export_areal_experiment",
]

AREAL_VERSION = "1.0.4"

# kit name -> the AReaL module that defines the same name: `areal.<path>` where the kit defines it at
# `areal_lite.<path>` (tests/test_package.py checks that for every entry).
AREAL_NAMES: Dict[str, str] = {
    # records passed between workflows, engine and trainer
    "ModelRequest": "areal.api.io_struct",
    "ModelResponse": "areal.api.io_struct",
    "WeightUpdateMeta": "areal.api.io_struct",
    "FinetuneSpec": "areal.api.io_struct",
    # configuration
    "GenerationHyperparameters": "areal.api.cli_args",
    "GRPOConfig": "areal.api.cli_args",
    "PPOActorConfig": "areal.api.cli_args",
    "InferenceEngineConfig": "areal.api.cli_args",
    "NormConfig": "areal.api.cli_args",
    "OptimizerConfig": "areal.api.cli_args",
    "MicroBatchSpec": "areal.api.cli_args",
    "SaverConfig": "areal.api.cli_args",
    "EvaluatorConfig": "areal.api.cli_args",
    "StatsLoggerConfig": "areal.api.cli_args",
    "BaseExperimentConfig": "areal.api.cli_args",
    "load_expr_config": "areal.api.cli_args",
    # workflows, rewards, engine, batches
    "RolloutWorkflow": "areal.api.workflow_api",
    "AsyncRewardWrapper": "areal.api.reward_api",
    "TrainEngine": "areal.api.engine_api",
    "InferenceEngine": "areal.api.engine_api",
    "gsm8k_reward_fn": "areal.reward.gsm8k",
    "geometry3k_reward_fn": "areal.reward.geometry3k",
    "clevr_count_70k_reward_fn": "areal.reward.clevr_count_70k",
    "MathVerifyWorker": "areal.reward",
    "get_math_verify_worker": "areal.reward",
    "RLVRWorkflow": "areal.workflow.rlvr",
    "MultiTurnWorkflow": "areal.workflow.multi_turn",
    "RemoteSGLangEngine": "areal.engine.sglang_remote",
    "RemotevLLMEngine": "areal.engine.vllm_remote",
    "InteractionCache": "areal.experimental.openai.cache",
    "InteractionWithTokenLogpReward": "areal.experimental.openai.types",
    "concat_prompt_token_ids_with_parent": "areal.experimental.openai.client",
    "StalenessManager": "areal.infra.staleness_manager",
    "load_hf_tokenizer": "areal.utils.hf_utils",
    "apply_chat_template": "areal.utils.hf_utils",
    "concat_padded_tensors": "areal.utils.data",
    "Normalization": "areal.utils.data",
    "pack_tensor_dict": "areal.utils.data",
    "pad_sequences_to_tensors": "areal.utils.data",
    "split_padded_tensor_dict_into_mb_list": "areal.utils.data",
    "unpack_sequence": "areal.utils.data",
    "reorder_list": "areal.utils.data",
    "pad_and_stack_tensors_along_first_dim": "areal.utils.data",
    "tensor_container_to": "areal.utils.data",
    "MicroBatchList": "areal.utils.data",
    "ppo_actor_loss_fn": "areal.utils.functional",
    "sapo_loss_fn": "areal.utils.functional",
    "apply_rejection_sampling": "areal.utils.functional",
    "RejectionSamplingConfig": "areal.api.cli_args",
    "cycle_dataloader": "areal.utils.data",
    "find_free_ports": "areal.utils.network",
    # the trainer: same methods and call order as AReaL's FSDP actor (see FSDPPPOActor's docstring)
    "FSDPPPOActor": "areal.engine.fsdp_engine",
}

# kit-only name -> what an AReaL 1.0.4 experiment does instead.
KIT_ONLY: Dict[str, str] = {
    "launch_server": "AReaL's launcher starts the servers (`python script.py --config ... scheduler.type=local`)",
    "ServerHandle": "the launcher owns server processes",
    "find_free_port": "the launcher picks ports",
    "launch_rag_server": "run your retrieval server yourself; the workflow only needs its URL",
    "resolve_model_path": "a Hugging Face id or local path in `actor.path`",
    "load_tokenizer": "`areal.utils.hf_utils.load_hf_tokenizer(path)`",
    "prepare_model": "weights come from the hub or a local folder",
    "load_gsm8k": "`areal.dataset.get_custom_dataset` / `datasets.load_dataset('openai/gsm8k')`",
    "load_dataset_from_config": "`areal.dataset.get_custom_dataset`",
    "make_dataloader": "`areal.utils.dataloader.create_dataloader` (a torchdata StatefulDataLoader)",
    "build_factbook_corpus": "your own corpus",
    "chat_prompt_ids": "`tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)`",
    "ppo_token_loss": "the per-token form of `areal.utils.functional.ppo_actor_loss_fn` (the same formula)",
    "check_trajectory": "AReaL checks shapes only (`areal.infra.check_trajectory_format`); keep the kit's in tests",
    "show_trajectory": "no viewer in AReaL",
    "plot_rewards": "AReaL logs to wandb/swanlab/tensorboard (`stats_logger`)",
    "plot_sync_vs_async": "AReaL logs timings through `stats_tracker`",
    "plot_time_breakdown": "AReaL logs timings through `stats_tracker`",
    "plot_response_length": "AReaL logs sequence lengths through `stats_tracker`",
    "plot_turns": "AReaL logs to wandb/swanlab/tensorboard (`stats_logger`)",
    "ConfigError": "AReaL raises hydra/omegaconf errors",
    "GroupedWorkflow": "pass `group_size=` to rollout_batch/prepare_batch (the kit accepts that too)",
    "ReflectionWorkflow": "closest: `areal.workflow.multi_turn.MultiTurnWorkflow`",
    "SearchAgentWorkflow": "write it against `areal.api.RolloutWorkflow` (notebook 05 does)",
    "MultiTurnFeedbackWorkflow": "AReaL's MultiTurnWorkflow gives one discounted reward per row (no per-turn returns)",
    "discounted_returns": "a three-line loop",
    "TrainConfig": "`areal.api.cli_args.GRPOConfig`",
    "train": "`areal.PPOTrainer(config, train_dataset).train(workflow)`",
    # rewards and tools: plain functions a cell calls (AReaL ships its own per-dataset rewards under areal.reward)
    "answer_reward": "`areal.reward.gsm8k.gsm8k_reward_fn`, which also pays an expression equal to the answer",
    "arithmetic_reward_fn": "`areal.reward.gsm8k.gsm8k_reward_fn`, which also pays a restated '4 + 3' for 7",
    "extract_answer": "part of `areal.reward` / math-verify",
    "math_equal": "part of `areal.reward` / math-verify",
    "f1_score": "write your own (the kit's counts tokens as a set or a multiset)",
    "exact_match": "write your own",
    "normalize_answer": "write your own",
    "parse_answer": "write your own tag parser",
    "parse_boxed": "write your own tag parser",
    "parse_search_query": "write your own tag parser",
    "call_search_tool": "an HTTP call to your retrieval server (ASearcher's `/retrieve` API)",
    "format_search_results": "format passages as your prompt expects",
    "OpenAIAgentWorkflow": "`areal.experimental.openai.OpenAIProxyWorkflow(mode='inline', agent=..., "
    "proxy_addr=..., discount=..., export_style=...)`; the agent class itself moves unchanged. Kit-only "
    "arguments: `discount_fn` (AReaL applies its own walk), `per_turn_returns` (AReaL trains a row with its leaf's "
    "reward) and `tool_syntax` (AReaL parses the model's own format)",
    "ChatServer": "AReaL's proxy server (`areal.experimental.openai.proxy`), started by its launcher; "
    "`tool_syntax='compact'` is kit-only (AReaL's `tool_call_parser` reads the model family's format)",
    "ChatSession": "AReaL's proxy server opens one session per episode (`OpenAIProxyClient`)",
    "Interaction": "`areal.experimental.openai.types.InteractionWithTokenLogpReward`",
    "interactions_to_batch": "AReaL's engine converts exported interactions itself (`to_tensor_dict`)",
    "parse_tool_calls": "`areal.experimental.openai.tool_call_parser.process_tool_calls`",
    "ChatTemplate": "`ArealOpenAI(chat_template_type='concat')`",
    "VersionCounter": "the engine or the trainer: any object with `get_version()` is a version provider",
    "check_cases": "a notebook exercise check; in tests, plain `assert` or pytest.approx",
    "request_sampling": "a notebook exercise check; in tests, read `request.gconfig`",
    "run_cells_defining": "put the code you wrote in a module and import it (AReaL runs scripts, not notebooks)",
    "describe_line": "`lscpu` (or `/proc/cpuinfo`): AReaL logs no CPU description",
    "EnvironmentWorkflow": "AReaL 1.0.4 has no environment class; this workflow runs under AReaL's engine and trainer "
    "as it is (after `register_with_areal()`), and TRL 1.16 takes the environment class as `environment_factory`",
    "inspect_environment": "TRL reads an environment's tools the same way (public methods, `get_json_schema`)",
    "GroupJudge": "AReaL has no judge: call your judge model in the workflow's reward (AReaL's `AsyncRewardWrapper` "
    "runs a reward per answer, so a relative judge belongs in a workflow that sees the whole group)",
    "pairwise_agreement": "a few lines: count the pairs the judge orders as the true reward does",
    "register_with_areal": "only needed for the kit's own workflows; one written against `areal.api` needs nothing",
}


# Where a name shared with AReaL 1.0.4 deliberately behaves otherwise: kit object -> what AReaL does, and why the
# kit does not. Everything else about these names is AReaL's (tests/test_areal_*.py and `make areal-judge` check it).
BETTER_THAN_AREAL: Dict[str, str] = {
    "areal_lite.workflow.multi_turn:MultiTurnWorkflow": "a reward that raises makes AReaL's rollout fail (its "
    "wrapper re-raises on the last retry); the kit scores it 0.0 and the episode goes on to its next turn. The "
    "reward's completion text is decoded without special tokens, as in every kit workflow",
    "areal_lite.engine.sglang_remote:RemoteSGLangEngine.rollout_batch": "at a fixed version AReaL's "
    "blocks (7 days, its default timeout) once the staleness bound is reached; the kit's runs synchronous episodes "
    "outside the bound and returns",
    "areal_lite.engine.sglang_remote:RemoteSGLangEngine.wait": "a failing workflow: AReaL logs the error and hands "
    "back None in the episode's place (rollout_batch drops it); the kit raises it, with the workflow's traceback and "
    "the episode's data",
    "areal_lite.infra.workflow_executor:WorkflowExecutor": "an episode whose per-token keys disagree in length is "
    "accepted by AReaL and fails later in the trainer; the kit refuses it at rollout, naming the keys and lengths",
    "areal_lite.utils.data:Normalization": "group normalisation of a batch that is not whole groups divides the "
    "leftover rows by eps in AReaL (x 1e5); the kit raises. Group statistics stay in float64",
    "areal_lite.utils.data:concat_padded_tensors": "a None (rejected) row or a 0-d tensor fails in "
    "AReaL with an AttributeError or RuntimeError that names neither, and keys of one row with different batch sizes "
    "yield a wrong batch; the kit raises a ValueError/TypeError that says which",
    "areal_lite.utils.data:cycle_dataloader": "a loader that yields nothing spins forever in AReaL; the kit raises "
    "after two empty epochs",
    "areal_lite.utils.functional:ppo_actor_loss_fn": "an invalid dual clip (c_clip <= 1) is a bare assert in AReaL, "
    "gone under python -O; the kit raises ValueError",
    "areal_lite.utils.functional:apply_rejection_sampling": "float64 inputs are cast down to float32 in AReaL; the "
    "kit keeps their precision (float32 and below give AReaL's numbers)",
    "areal_lite.reward.clevr_count_70k:clevr_count_70k_reward_fn": "a non-string completion raises in AReaL and "
    "can take down a rollout batch; the kit scores 0.0, as AReaL's other rewards do",
    "areal_lite.experimental.openai.cache:InteractionCache": "AReaL keeps the first row it builds, so a reward set "
    "afterwards is lost, and its 'individual' rows train the ancestors' outputs again; the kit rebuilds each export "
    "and trains each interaction's own output once. NaN/inf rewards are refused; an unknown export style raises "
    "even on an empty cache; `last_interaction_id` of an empty cache is a KeyError, not a StopIteration",
    "areal_lite.experimental.openai.types:InteractionWithTokenLogpReward": "a child prompt that does not extend its "
    "parent's tokens (a parent that stopped on a pad token) gets the parent's loss mask and log-probs copied by "
    "position in AReaL, so a token the model never generated is trained; the kit's row raises",
    "areal_lite.utils.hf_utils:load_hf_tokenizer": "AReaL forces a fresh download, which fails offline; the kit "
    "loads from the cache or a local folder",
}


def _is_kit_import(node: ast.AST) -> bool:
    return isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "areal_lite"


def areal_import_lines(module: str, names: Iterable[str]) -> List[str]:
    """The AReaL 1.0.4 version of `from <module> import <names>`, where `module` is `areal_lite` or under it.

    The rule: a name with an AReaL twin moves to the same path with the prefix `areal_lite.` -> `areal.`
    (`from areal_lite.api.cli_args import GRPOConfig` -> `from areal.api.cli_args import GRPOConfig`); imported from
    the package root, it moves to its AReaL module (`AREAL_NAMES`). A kit-only name (`KIT_ONLY`, or anything
    imported from `areal_lite.kit`) stays imported as it was.
    """
    moved: Dict[str, List[str]] = {}
    kept: List[str] = []
    in_kit = module == "areal_lite.kit" or module.startswith("areal_lite.kit.")
    for name in names:
        if name in KIT_ONLY or in_kit:
            kept.append(name)
        elif name in AREAL_NAMES:
            target = AREAL_NAMES[name] if module == "areal_lite" else "areal" + module[len("areal_lite") :]
            moved.setdefault(target, []).append(name)
        else:
            raise KeyError(f"{name!r} is in neither AREAL_NAMES nor KIT_ONLY: list it in areal_lite.kit.areal.compat")
    lines = [f"from {target} import {', '.join(ns)}" for target, ns in moved.items()]
    return lines + ([f"from {module} import {', '.join(kept)}"] if kept else [])


def areal_object(name: str):
    """The AReaL 1.0.4 object that kit name `name` stands for (imports AReaL: heavy)."""
    import importlib

    return getattr(importlib.import_module(AREAL_NAMES[name]), name)


def _imported_names(node: ast.ImportFrom) -> List[str]:
    for alias in node.names:
        if alias.asname is not None:
            raise ValueError(f"`from {node.module} import {alias.name} as {alias.asname}`: rename after importing")
    return [alias.name for alias in node.names]


def to_areal_cell(source: str) -> str:
    """The AReaL 1.0.4 version of a notebook cell: its `from areal_lite... import` statements rewritten by
    `areal_import_lines`. Only import statements change; every other line is returned as it is (the kit's claim).
    """
    if "areal_lite" not in source:
        return source
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    edits = []  # (first line, last line, replacement), 1-based inclusive
    for node in tree.body:
        if _is_kit_import(node):
            text = "".join(line + "\n" for line in areal_import_lines(node.module, _imported_names(node)))
            edits.append((node.lineno, node.end_lineno, text))
    for first, last, text in reversed(edits):
        lines[first - 1 : last] = [text]
    return "".join(lines)


def register_with_areal() -> None:
    """Make AReaL 1.0.4's engine accept the kit's workflows (`isinstance(wf, areal.api.RolloutWorkflow)`).

    Call it once in a process that runs kit workflows under AReaL's engine; a workflow a learner writes against
    `areal.api.RolloutWorkflow` needs nothing."""
    from areal.api import RolloutWorkflow as AReaLRolloutWorkflow

    from areal_lite.api.workflow_api import RolloutWorkflow

    if not issubclass(RolloutWorkflow, AReaLRolloutWorkflow):
        AReaLRolloutWorkflow.register(RolloutWorkflow)


_SCRIPT = '''"""{name}: an AReaL {version} experiment exported by areal-lite (notebook 08).

The cells below are the notebook's, with their imports rewritten for AReaL; kit-only helpers they use are still
imported from `areal_lite` (install it beside AReaL). Run where the servers can start (a GPU machine or cluster):

    {run}
"""

import json
import os
import sys

from datasets import Dataset

from areal import PPOTrainer
from areal.api.cli_args import GRPOConfig, load_expr_config
from areal.utils.hf_utils import load_hf_tokenizer

{constants}
# ---------------------------------------------------------------------------------------------- notebook cells
{cells}

# ---------------------------------------------------------------------------------------------- the experiment
def main(argv):
    config, _ = load_expr_config(argv, GRPOConfig)
    tokenizer = load_hf_tokenizer(config.tokenizer_path)
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "{name}_train.jsonl"), encoding="utf-8") as fh:
        train_dataset = Dataset.from_list([json.loads(line) for line in fh])
    workflow_kwargs = {workflow_kwargs}
    with PPOTrainer(config, train_dataset=train_dataset) as trainer:
        trainer.train(workflow={workflow}, workflow_kwargs=workflow_kwargs)


if __name__ == "__main__":
    main(sys.argv[1:])
'''


def export_areal_experiment(
    out_dir: str,
    name: str,
    cells: List[str],
    workflow: str,
    workflow_kwargs: str,
    config: dict,
    rows: List[dict],
    constants: Dict[str, object] | None = None,
) -> Dict[str, str]:
    """Write a runnable AReaL experiment: `<name>.py`, `<name>.yaml` and `<name>_train.jsonl` in `out_dir`.

    `cells`: notebook code cells (kit version) that define the workflow; they are written as `to_areal_cell` turns
    them (imports only). `workflow`: the class name they define. `workflow_kwargs`: Python source of the keyword
    dict given to it, evaluated in `main` where `config` (AReaL's GRPOConfig), `tokenizer` and `os` exist.
    `config`: an AReaL config as a dict (from `areal_lite.kit.areal.config`). `constants`: module-level values the cells
    read (written with repr). Returns the three paths.
    """
    import json
    import os

    import yaml

    os.makedirs(out_dir, exist_ok=True)
    paths = {
        kind: os.path.join(out_dir, f"{name}{suffix}")
        for kind, suffix in (("script", ".py"), ("config", ".yaml"), ("data", "_train.jsonl"))
    }
    run = f"python {name}.py --config {name}.yaml scheduler.type=local"
    consts = "".join(f"{k} = {v!r}\n" for k, v in (constants or {}).items())
    body = "\n\n".join(to_areal_cell(c).rstrip("\n") for c in cells)
    script = _SCRIPT.format(
        name=name,
        version=AREAL_VERSION,
        run=run,
        constants=consts,
        cells=body,
        workflow=workflow,
        workflow_kwargs=workflow_kwargs,
    )
    ast.parse(script)  # a cell that is not plain Python (top-level await, magics) cannot be exported
    with open(paths["script"], "w", encoding="utf-8") as fh:
        fh.write(script)
    with open(paths["config"], "w", encoding="utf-8") as fh:
        yaml.safe_dump(config, fh, sort_keys=False)
    with open(paths["data"], "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(row) + "\n" for row in rows)
    return paths
