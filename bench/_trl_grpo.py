"""TRL's side of `bench/vs_trl.py`: the kit demo's training run with TRL's `GRPOTrainer`, in TRL's own venv.

    .venv-trl/bin/python bench/_trl_grpo.py SPEC.json OUT.json

Not run by hand: `vs_trl.py` writes SPEC.json (the kit's model folder, its reward as `module:function`, the
hyperparameters read from the kit's config, and the training prompts in the kit's dataloader order as chat messages
with the kit's prompt token ids) and reads OUT.json back (times, per-step rewards, the folder of the trained model).
The only thing imported from the kit is its reward function (`areal_lite.reward.gsm8k` needs the standard library,
aiohttp and math-verify, all in `.venv-trl`), so both runs score with the same code.

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


def main() -> int:
    spec_path, out_path = sys.argv[1], sys.argv[2]
    with open(spec_path, encoding="utf-8") as fh:
        spec = json.load(fh)
    threads = int(spec["threads"])
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ["HF_HUB_OFFLINE"] = "1"

    import torch

    torch.set_num_threads(threads)
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    hp = spec["hyper"]
    steps = int(spec["steps"])
    group = int(hp["n_samples"])
    batch_prompts = int(hp["batch_size"])
    rows = spec["train"]
    if len(rows) != steps * batch_prompts:
        raise SystemExit(f"_trl_grpo: {len(rows)} training rows for {steps} steps of {batch_prompts} prompts")
    kit_reward = load_reward(spec["reward"])

    def kit_answer_reward(prompts, completions, completion_ids, answer, **kwargs):
        """TRL's reward signature around the kit's: the completion's text (decoded with special tokens skipped, as
        the kit decodes it) and the row's answer. The kit's reward reads neither the prompt nor the ids."""
        return [
            float(kit_reward(p[-1]["content"], c[-1]["content"], None, ids, a))
            for p, c, ids, a in zip(prompts, completions, completion_ids, answer)
        ]

    tokenizer = AutoTokenizer.from_pretrained(spec["model_path"])
    if tokenizer.pad_token_id is None:  # as the kit's load_tokenizer
        tokenizer.pad_token_id = tokenizer.eos_token_id
    dataset = Dataset.from_list([{"prompt": r["messages"], "answer": r["answer"]} for r in rows])

    config = GRPOConfig(
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
        bf16=False,
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

    clock = Clock()
    trainer = Trainer(
        model=spec["model_path"],
        reward_funcs=kit_answer_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    model_dtype = str(next(trainer.model.parameters()).dtype)
    if trainer.args.activation_checkpointing or trainer.model.is_activation_checkpointing:
        raise SystemExit("_trl_grpo: activation checkpointing is on; the kit trains without it")
    t0 = time.perf_counter()
    trainer.train()
    train_wall = time.perf_counter() - t0
    threads_after = torch.get_num_threads()

    # The prompts TRL generated from, step by step: the kit's batch k, each prompt `group` times, same ids.
    seen = trainer.bench_prompt_ids
    if len(seen) != steps:
        raise SystemExit(f"_trl_grpo: TRL generated {len(seen)} times in {steps} steps (expected one per step)")
    for k, ids in enumerate(seen):
        want = [r["prompt_ids"] for r in rows[k * batch_prompts : (k + 1) * batch_prompts] for _ in range(group)]
        if ids != want:
            raise SystemExit(f"_trl_grpo: step {k}: TRL's prompt token ids differ from the kit's batch {k}")

    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper holds torch's
    final_dir = os.path.join(spec["out_dir"], "final")
    trainer.save_model(final_dir)
    step_logs = [lg for lg in clock.logs if "reward" in lg]
    out = {
        "train_wall_s": train_wall,
        "step_s": clock.steps,
        "phase_s": trainer.bench_phase,
        "reward_by_step": [lg["reward"] for lg in step_logs],
        "completion_length_by_step": [lg.get("completions/mean_length") for lg in step_logs],
        "trl_step_time_by_step": [lg.get("step_time") for lg in step_logs],
        "prompt_ids_checked": True,
        "prompt_token_ids_step0": seen[0][0],
        "model_dir": final_dir,
        "model_dtype": model_dtype,
        "torch_threads": threads_after,
        "optimizer": type(optimizer).__name__,
        "optimizer_defaults": {k: v for k, v in optimizer.param_groups[0].items() if k in OPTIMIZER_KEYS},
        "versions": _versions(),
    }
    with open(out_path, "w", encoding="utf-8") as fh:
        json.dump(out, fh, indent=1)
    print(f"_trl_grpo: {steps} steps in {train_wall:.1f} s; rewards {[round(r, 2) for r in out['reward_by_step']]}")
    return 0


def _versions() -> dict:
    import importlib.metadata as md

    return {n: md.version(n) for n in ("trl", "torch", "transformers", "accelerate", "datasets", "math-verify")}


if __name__ == "__main__":
    sys.exit(main())
