"""TRL's side of `bench/vs_trl.py`: the kit demo's training run with TRL's `GRPOTrainer`, in TRL's own venv.

    .venv-trl/bin/python bench/_trl_grpo.py SPEC.json OUT.json

Not run by hand: `vs_trl.py` writes SPEC.json (the kit's model folder, its reward as `module:function`, the
hyperparameters read from the kit's config, and the training prompts in the kit's dataloader order as chat messages
with the kit's prompt token ids) and reads OUT.json back (times, per-step rewards, the folder of the trained model).
The only thing imported from the kit is its reward function (the demo's `areal_lite.reward.arithmetic`; the kit's
rewards need only the standard library, aiohttp and math-verify, all in `.venv-trl`), so both runs score with the same
code.

Checked here, and the run refuses to go on otherwise: the token ids TRL builds from each chat prompt equal the
kit's, and the prompts TRL trains on at step k are the kit's batch k, each repeated `num_generations` times.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPTIMIZER_KEYS = ("lr", "betas", "eps", "weight_decay", "fused", "foreach")


def load_reward(name: str):
    """The kit's reward (`module:function`), imported from the checkout: nothing else of the kit is on the path."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    module, fn = name.split(":", 1)
    return getattr(importlib.import_module(module), fn)


def read_spec(path: str) -> dict:
    """The run's spec, as `vs_trl.py` wrote it."""
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def configure_runtime(threads: int) -> None:
    """Threads and offline mode for this process, set before torch and TRL's stack are first imported."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ["HF_HUB_OFFLINE"] = "1"

    import torch

    torch.set_num_threads(threads)
    # TRL's stack is first imported here, after the settings above and in this order; the helpers below import what
    # they use from it again (a look-up in sys.modules).
    from datasets import Dataset  # noqa: F401
    from transformers import AutoTokenizer, TrainerCallback  # noqa: F401
    from trl import GRPOConfig, GRPOTrainer  # noqa: F401


def run_shape(spec: dict) -> tuple[int, int, int]:
    """Steps, prompts per step and completions per prompt; refuses a spec whose rows are not exactly those steps."""
    hp = spec["hyper"]
    steps = int(spec["steps"])
    group = int(hp["n_samples"])
    batch_prompts = int(hp["batch_size"])
    rows = spec["train"]
    if len(rows) != steps * batch_prompts:
        raise SystemExit(f"_trl_grpo: {len(rows)} training rows for {steps} steps of {batch_prompts} prompts")
    return steps, batch_prompts, group


def answer_reward(kit_reward):
    """The kit's reward function `kit_reward` as a TRL reward function (`kit_answer_reward`, TRL logs that name)."""

    def kit_answer_reward(prompts, completions, completion_ids, answer, **kwargs):
        """TRL's reward signature around the kit's: the completion's text (decoded with special tokens skipped, as
        the kit decodes it) and the row's answer. The kit's reward reads neither the prompt nor the ids."""
        return [
            float(kit_reward(p[-1]["content"], c[-1]["content"], None, ids, a))
            for p, c, ids, a in zip(prompts, completions, completion_ids, answer)
        ]

    return kit_answer_reward


def load_tokenizer(model_path: str):
    """The model's tokenizer, with the kit's pad token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token_id is None:  # as the kit's load_tokenizer
        tokenizer.pad_token_id = tokenizer.eos_token_id
    return tokenizer


def build_dataset(rows: list[dict]):
    """The exported rows as TRL's dataset: the chat prompt and the answer the reward reads."""
    from datasets import Dataset

    return Dataset.from_list([{"prompt": r["messages"], "answer": r["answer"]} for r in rows])


def grpo_config(spec: dict, steps: int, batch_prompts: int, group: int):
    """The kit's hyperparameters (`spec["hyper"]`) as TRL's `GRPOConfig`."""
    from trl import GRPOConfig

    hp = spec["hyper"]
    return GRPOConfig(
        output_dir=spec["out_dir"],
        use_cpu=True,
        seed=int(spec["seed"]),
        max_steps=steps,
        # One optimizer step = one generation of batch_prompts x group completions, used once (no reuse, no
        # gradient accumulation): the kit's synchronous step.
        per_device_train_batch_size=batch_prompts * group,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        num_generations=group,
        shuffle_dataset=False,  # the kit's order, as exported
        max_completion_length=int(hp["max_new_tokens"]),
        temperature=float(hp["temperature"]),
        top_p=float(hp["top_p"]),
        top_k=0,  # all tokens (the kit: top_k >= 1e8)
        # the loss: token-level mean over the whole batch, group-normalised advantages, no KL
        loss_type="dapo",
        beta=0.0,
        scale_rewards="group",
        epsilon=float(hp["eps_clip"]),
        mask_truncated_completions=False,
        use_vllm=False,
        # the optimizer: AdamW, constant learning rate, gradient clipping, float32
        learning_rate=float(hp["lr"]),
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=float(hp["beta1"]),
        adam_beta2=float(hp["beta2"]),
        adam_epsilon=float(hp["adam_eps"]),
        weight_decay=float(hp["weight_decay"]),
        max_grad_norm=float(hp["gradient_clipping"]),
        optim="adamw_torch_fused",  # the kit's AdamW is fused too
        bf16=bool(hp.get("bf16", False)),  # float32 weights either way; True: forward passes under bf16 autocast
        fp16=False,
        model_init_kwargs={"dtype": "float32"},
        activation_checkpointing=False,  # transformers 5's name; TRL's default (gradient_checkpointing=True) is off
        # nothing but the run: no checkpoints, no hub, no trackers, a log line per step (read by the callback)
        save_strategy="no",
        report_to="none",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def timed_trainer_class():
    """`GRPOTrainer` subclassed to time its phases and record its prompt ids (defined here: TRL is imported late)."""
    from trl import GRPOTrainer

    class Trainer(GRPOTrainer):
        """GRPOTrainer with clocks around its phases and a record of the prompt ids it generated from. Nothing else
        is changed: each override calls the original and returns what it returned."""

        def __init__(self, *args, **kwargs):
            self.bench_prompt_ids: list = []
            self.bench_phase = {"generate": [], "score": [], "rollout": []}
            super().__init__(*args, **kwargs)

        def _tokenize_prompts(self, prompts):
            out = super()._tokenize_prompts(prompts)
            self.bench_prompt_ids.append([list(map(int, ids)) for ids in out[0]])
            return out

        def _generate_single_turn(self, *args, **kwargs):
            t = time.perf_counter()
            out = super()._generate_single_turn(*args, **kwargs)
            self.bench_phase["generate"].append(time.perf_counter() - t)
            return out

        def _calculate_rewards(self, *args, **kwargs):
            t = time.perf_counter()
            out = super()._calculate_rewards(*args, **kwargs)
            self.bench_phase["score"].append(time.perf_counter() - t)
            return out

        def _generate_and_score_completions(self, *args, **kwargs):
            t = time.perf_counter()
            out = super()._generate_and_score_completions(*args, **kwargs)
            self.bench_phase["rollout"].append(time.perf_counter() - t)
            return out

    return Trainer


def make_clock():
    """A callback that times each optimizer step and keeps TRL's log lines (defined here: transformers loads late)."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        """Wall time of each optimizer step (from on_step_begin to on_step_end) and TRL's own log lines."""

        def __init__(self):
            self.steps: list = []
            self.logs: list = []
            self._t = None

        def on_step_begin(self, args, state, control, **kwargs):
            self._t = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append(time.perf_counter() - self._t)

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs or {}, step=state.global_step))

    return Clock()


def build_trainer(spec: dict, reward_fn, config, dataset, tokenizer, clock):
    """The timed GRPOTrainer on the kit's model; refuses one that trains with activation checkpointing."""
    trainer = timed_trainer_class()(
        model=spec["model_path"],
        reward_funcs=reward_fn,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    if trainer.args.activation_checkpointing or trainer.model.is_activation_checkpointing:
        raise SystemExit("_trl_grpo: activation checkpointing is on; the kit trains without it")
    return trainer


def train(trainer) -> tuple[float, int]:
    """`trainer.train()`: its wall time and torch's thread count after it."""
    import torch

    t0 = time.perf_counter()
    trainer.train()
    train_wall = time.perf_counter() - t0
    return train_wall, torch.get_num_threads()


def check_prompt_ids(seen: list, rows: list[dict], steps: int, batch_prompts: int, group: int) -> None:
    """Refuses the run unless TRL generated once per step, from the kit's batch k at step k with the kit's ids."""
    # The prompts TRL generated from, step by step: the kit's batch k, each prompt `group` times, same ids.
    if len(seen) != steps:
        raise SystemExit(f"_trl_grpo: TRL generated {len(seen)} times in {steps} steps (expected one per step)")
    for k, ids in enumerate(seen):
        want = [r["prompt_ids"] for r in rows[k * batch_prompts : (k + 1) * batch_prompts] for _ in range(group)]
        if ids != want:
            raise SystemExit(f"_trl_grpo: step {k}: TRL's prompt token ids differ from the kit's batch {k}")


def collect_results(spec: dict, trainer, clock, train_wall: float, model_dtype: str, torch_threads: int) -> dict:
    """Saves the trained model under `out_dir/final` and returns what `vs_trl.py` reads back."""
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper holds torch's
    final_dir = os.path.join(spec["out_dir"], "final")
    trainer.save_model(final_dir)
    step_logs = [lg for lg in clock.logs if "reward" in lg]
    return {
        "train_wall_s": train_wall,
        "step_s": clock.steps,
        "phase_s": trainer.bench_phase,
        "reward_by_step": [lg["reward"] for lg in step_logs],
        "completion_length_by_step": [lg.get("completions/mean_length") for lg in step_logs],
        "trl_step_time_by_step": [lg.get("step_time") for lg in step_logs],
        "prompt_ids_checked": True,
        "prompt_token_ids_step0": trainer.bench_prompt_ids[0][0],
        "model_dir": final_dir,
        "model_dtype": model_dtype,
        "mixed_precision": str(trainer.accelerator.mixed_precision),  # "bf16": forward passes under autocast
        "torch_threads": torch_threads,
        "optimizer": type(optimizer).__name__,
        "optimizer_defaults": {k: v for k, v in optimizer.param_groups[0].items() if k in OPTIMIZER_KEYS},
        "versions": _versions(),
    }


def write_results(out_path: str, out: dict, steps: int) -> None:
    """OUT.json, and the run's one printed line."""
    with open(out_path, "w", encoding="utf-8") as fh:
        json.dump(out, fh, indent=1)
    rewards = [round(r, 2) for r in out["reward_by_step"]]
    print(f"_trl_grpo: {steps} steps in {out['train_wall_s']:.1f} s; rewards {rewards}")


def main() -> int:
    spec_path, out_path = sys.argv[1], sys.argv[2]
    spec = read_spec(spec_path)
    configure_runtime(int(spec["threads"]))
    steps, batch_prompts, group = run_shape(spec)
    reward_fn = answer_reward(load_reward(spec["reward"]))
    tokenizer = load_tokenizer(spec["model_path"])
    dataset = build_dataset(spec["train"])
    config = grpo_config(spec, steps, batch_prompts, group)
    clock = make_clock()
    trainer = build_trainer(spec, reward_fn, config, dataset, tokenizer, clock)
    model_dtype = str(next(trainer.model.parameters()).dtype)
    train_wall, torch_threads = train(trainer)
    check_prompt_ids(trainer.bench_prompt_ids, spec["train"], steps, batch_prompts, group)
    out = collect_results(spec, trainer, clock, train_wall, model_dtype, torch_threads)
    write_results(out_path, out, steps)
    return 0


def _versions() -> dict:
    import importlib.metadata as md

    return {n: md.version(n) for n in ("trl", "torch", "transformers", "accelerate", "datasets", "math-verify")}


if __name__ == "__main__":
    sys.exit(main())
