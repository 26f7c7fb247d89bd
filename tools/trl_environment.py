"""Run a TRL/OpenEnv-shaped environment class, unchanged, for a few steps of TRL's `GRPOTrainer(environment_factory=)`.

Usage (TRL's own venv, `make test-trl-env`; CPU; no network):
    .venv-trl/bin/python tools/trl_environment.py --model MODEL_DIR --env FILE.py:ClassName \
        (--rows ROWS.json | --seeds N) [--steps 2] [--out OUT.json]

Why: the environment class the notebook's learner writes (`reset(**row)` returning the question, public methods as
tools, `get_reward()` as the reward) is meant to be the same class TRL trains with. This script proves it: it imports
the class from its file (tests/test_trl_environment.py writes notebook 11's cell to one), builds a
`datasets.Dataset` from ROWS.json (each row a `prompt` plus the fields `reset` takes; `--seeds N`: rows with an
empty user turn and `seed` 0..N-1) and runs GRPOTrainer with `environment_factory=` the class, no `reward_funcs`.
The class is not subclassed or wrapped; the factory only records the instances it creates.
The model only has to run, not learn. A chat template that cannot render tool calls (e.g. SmolLM2's plain ChatML) is
replaced by TRL's own copy of Qwen2.5's template (same ChatML tokens), which TRL recognises: it then sets the
matching response parser itself, so tool calls are parsed by TRL's own code.
OUT.json: versions, steps run, per-step `rewards/<ClassName>/mean`, TRL's `tools/*` metrics, tool calls and
failures counted from the logged completions, instances created, and how many prompts got `reset`'s observation.
This file must not import areal_lite: TRL's venv does not have the kit's dependencies.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import sys
import tempfile
import time
import types
from pathlib import Path


def load_class(spec: str):
    """`path/to/file.py:ClassName` -> the class, executed from that file as a module."""
    file, _, name = spec.rpartition(":")
    if not file or not name:
        raise SystemExit(f"--env must be FILE.py:ClassName, got {spec!r}")
    module_name = Path(file).stem
    module = types.ModuleType(module_name)
    module.__file__ = file
    sys.modules[module_name] = module
    exec(compile(Path(file).read_text(encoding="utf-8"), file, "exec"), module.__dict__)
    return getattr(module, name)


def parse_args() -> argparse.Namespace:
    """The command line (see the module's docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="local Hugging Face model folder")
    parser.add_argument("--env", required=True, help="FILE.py:ClassName")
    rows_from = parser.add_mutually_exclusive_group(required=True)
    rows_from.add_argument("--rows", help="JSON list of rows: {'prompt': [...messages], **reset kwargs}")
    rows_from.add_argument("--seeds", type=int, help="N rows {'prompt': [empty user turn], 'seed': k}, k < N")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", default=None)
    parser.add_argument("--max-completion-length", type=int, default=48)
    parser.add_argument("--max-tool-calls", type=int, default=2, help="max_tool_calling_iterations")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def configure_runtime() -> None:
    """Offline mode and TRL's experimental warnings silenced, set before TRL's stack is first imported."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    # TRL's stack is first imported here, after the settings above and in this order; the helpers below import what
    # they use from it again (a look-up in sys.modules).
    import trl  # noqa: F401
    from datasets import Dataset  # noqa: F401
    from transformers import AutoTokenizer, TrainerCallback  # noqa: F401
    from trl import GRPOConfig, GRPOTrainer  # noqa: F401
    from trl.chat_template_utils import qwen2_5_chat_template, supports_tool_calling  # noqa: F401


def load_rows(args: argparse.Namespace) -> list[dict]:
    """The training rows: `--rows`' JSON, or `--seeds N` rows with an empty user turn and `seed` 0..N-1."""
    if args.rows:
        return json.loads(Path(args.rows).read_text())
    return [{"prompt": [{"role": "user", "content": ""}], "seed": k} for k in range(args.seeds)]


def build_dataset(rows: list[dict]):
    """The rows as TRL's dataset, as they are."""
    from datasets import Dataset

    return Dataset.from_list(rows)


def load_tokenizer(model: str):
    """The model's tokenizer, and whether its chat template was replaced by TRL's Qwen2.5 one to render tools."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen2_5_chat_template, supports_tool_calling

    tokenizer = AutoTokenizer.from_pretrained(model)
    template_swapped = not supports_tool_calling(tokenizer)
    if template_swapped:
        tokenizer.chat_template = qwen2_5_chat_template
    return tokenizer, template_swapped


def make_factory(env_class) -> tuple:
    """An `environment_factory` that creates `env_class()` unchanged, and the list of the instances it created."""
    instances = []

    def factory():
        instance = env_class()
        instances.append(instance)
        return instance

    return factory, instances


def make_recorder(rows: list[dict], env_class):
    """A callback recording each step's logged rollouts in `.steps`; it reads them from `.trainer`, set once built."""
    from transformers import TrainerCallback

    class Record(TrainerCallback):
        def __init__(self):
            self.trainer = None
            self.steps = []

        def on_log(self, _args, state, control, logs=None, **kwargs):
            if logs is None or "loss" not in logs:
                return
            completions = list(self.trainer._logs["completion"])
            tool_msgs = [m for c in completions for m in c if m.get("role") == "tool"]
            errors = [m["content"] for m in tool_msgs if str(m["content"]).startswith("{'error'")]
            prompts = list(self.trainer._logs["prompt"])
            row_texts = {json.dumps(r["prompt"][-1]["content"]) for r in rows}
            self.steps.append(
                {
                    "step": state.global_step,
                    "reward_mean": logs.get(f"rewards/{env_class.__name__}/mean"),
                    "tools/call_frequency": logs.get("tools/call_frequency"),
                    "tools/failure_frequency": logs.get("tools/failure_frequency"),
                    "rollouts": len(completions),
                    "tool_calls": len(tool_msgs),
                    "tool_errors": errors,
                    "prompts_with_observation": sum(json.dumps(p[-1]["content"]) not in row_texts for p in prompts),
                    "sample_prompt": prompts[0][-1]["content"] if prompts else None,
                    "sample_completion": completions[0] if completions else None,
                }
            )

    return Record()


def grpo_config(args: argparse.Namespace):
    """A small CPU GRPOConfig: two prompts of two generations a step, a log line per step, nothing saved."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_env_"),
        max_steps=args.steps,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=args.max_completion_length,
        max_tool_calling_iterations=args.max_tool_calls,
        use_vllm=False,
        use_cpu=True,
        bf16=False,
        fp16=False,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        seed=args.seed,
    )


def train(model: str, config, dataset, tokenizer, factory, recorder) -> tuple:
    """GRPOTrainer with the environment factory and no reward functions, trained; the trainer and its wall time."""
    from trl import GRPOTrainer

    start = time.perf_counter()
    trainer = GRPOTrainer(
        model=model,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        environment_factory=factory,
        callbacks=[recorder],
    )
    recorder.trainer = trainer
    trainer.train()
    return trainer, time.perf_counter() - start


def collect_result(args, trainer, tokenizer, template_swapped: bool, instances: list, steps: list, wall: float) -> dict:
    """OUT.json's content: versions, what TRL found in the class, and what the steps recorded."""
    import trl

    metric_names = sorted({k for entry in trainer.state.log_history for k in entry})
    return {
        "trl": trl.__version__,
        "transformers": md.version("transformers"),
        "torch": md.version("torch"),
        "env": args.env,
        "chat_template": "trl qwen2_5 (model's own cannot render tools)" if template_swapped else "model's own",
        "response_template_set": getattr(tokenizer, "response_template", None) is not None,
        "tools": sorted(t.__name__ for t in trainer.tools),
        "reward_sources": trainer.reward_func_names,
        "steps_run": trainer.state.global_step,
        "instances_created": len(instances),
        "tool_calls": sum(s["tool_calls"] for s in steps),
        "prompts_with_observation": sum(s["prompts_with_observation"] for s in steps),
        "wall_s": round(wall, 1),
        "per_step": steps,
        "metric_names": metric_names,
    }


def write_result(args: argparse.Namespace, result: dict, env_class) -> None:
    """OUT.json (with `--out`), and the run's one printed line."""
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    steps = result["per_step"]
    print(
        f"trl {result['trl']}: {args.env} ran {result['steps_run']} steps in {result['wall_s']} s; "
        f"tools {result['tools']}; rewards/{env_class.__name__}/mean per step "
        f"{[s['reward_mean'] for s in steps]}; tool calls {result['tool_calls']}; "
        f"{result['prompts_with_observation']} prompts carried reset()'s observation; "
        f"{result['instances_created']} instances"
    )


def main() -> None:
    args = parse_args()
    configure_runtime()
    env_class = load_class(args.env)
    rows = load_rows(args)
    dataset = build_dataset(rows)
    tokenizer, template_swapped = load_tokenizer(args.model)
    factory, instances = make_factory(env_class)
    recorder = make_recorder(rows, env_class)
    config = grpo_config(args)
    trainer, wall = train(args.model, config, dataset, tokenizer, factory, recorder)
    result = collect_result(args, trainer, tokenizer, template_swapped, instances, recorder.steps, wall)
    write_result(args, result, env_class)


if __name__ == "__main__":
    main()
