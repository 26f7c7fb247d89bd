"""The GRPO loop as one script: `python -m areal_lite.kit.trainer.train --config FILE [key=value ...] [--resume]`.

The notebooks spell out the same loop cell by cell; `train(config)` runs it in-process. One step (`grpo_step`):

    batch = engine.rollout_batch(data, workflow)       # async: engine.prepare_batch(dataloader, workflow)
    actor.compute_advantages(batch); stats = actor.ppo_update(batch); actor.step_lr_scheduler()
    engine.pause(); fut = engine.update_weights(meta); actor.update_weights(meta); fut.result()
    actor.set_version(step + 1); engine.set_version(step + 1); engine.resume()

Design decisions
- `TrainConfig` is a `GRPOConfig` plus the choices a script needs (workflow, reward): any GRPOConfig YAML loads.
- The server is a child process (`launch_server`) that dies with the trainer, launched first and awaited last (its
  model load overlaps the trainer's set-up); `server_addrs=` reuses running ones.
- Weights go through disk, to a RAM folder the run owns (`utils.weight_dirs`); both sides' versions are bumped
  before `resume()`, so every later rollout is tagged with the new one (`_sync_weights`).
- Async (`async_training=true`): `prepare_batch` under eta = `rollout.max_head_offpolicyness`, the lag corrected
  by the decoupled loss. Evaluation is greedy, through its own engine client: outside the staleness bound.
- A run folder is never silently reused (`kit.trainer.rundir`); `--resume` continues from the newest checkpoint at
  the same step and data position. LoRA (`actor.use_lora`): each sync writes the adapter alone (`_start_weights`).
- Statistics: one JSON line per step in `stats.jsonl` (`StatsLogger`), optionally TensorBoard and W&B.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import importlib
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from areal_lite.api.cli_args import (
    ConfigError,
    GRPOConfig,
    InferenceEngineConfig,
    describe,
    load_expr_config,
    reconcile_lora,
    reconcile_temperature,
    server_backend,
)
from areal_lite.api.engine_api import InferenceEngine
from areal_lite.api.io_struct import FinetuneSpec, WeightUpdateMeta
from areal_lite.api.reward_api import AsyncRewardWrapper
from areal_lite.api.workflow_api import RolloutWorkflow
from areal_lite.kit.trainer.rundir import (
    TRAINER_STATE,
    RunDir,
    RunDirError,
    check_writable,
    damaged,
    open_run_dir,
)
from areal_lite.utils.atomic import atomic_dir
from areal_lite.utils.data import concat_padded_tensors
from areal_lite.utils.model_store import ModelPathError
from areal_lite.utils.weight_dirs import NoRoomError, check_room, written_version_bytes

if TYPE_CHECKING:
    from torchdata.stateful_dataloader import StatefulDataLoader
    from transformers import PreTrainedTokenizerBase

    from areal_lite.engine.fsdp_engine import FSDPPPOActor

__all__ = [
    "TrainConfig", "train", "grpo_step", "main", "build_workflow", "build_eval_workflow", "resolve_reward",
    "config_reward", "evaluate", "evaluation_batch", "batch_stats",
]  # fmt: skip

WORKFLOWS = ("rlvr", "reflection", "multiturn")
# What the command lines (this one, the demo) print in one line without a traceback: each message says what to do.
ONE_LINE_ERRORS = (ConfigError, ModelPathError, RunDirError, NoRoomError)
USAGE = """usage: python -m areal_lite.kit.trainer.train --config FILE [key=value ...] [--resume]

GRPO as configured in FILE (e.g. configs/arith_grpo_demo.yaml); key=value overrides any field, profile=cpu|gpu|auto
picks the hardware profile. --resume continues the run from its newest checkpoint. The fields:"""


@dataclass
class TrainConfig(GRPOConfig):
    """GRPOConfig plus what the script chooses that the notebooks write as code."""

    workflow: str = field(default="rlvr", metadata={"help": "rollout workflow", "choices": WORKFLOWS})
    reward: str = field(
        default="auto",
        metadata={
            "help": "reward: auto (by train_dataset.type), gsm8k, arith, or module:function with AReaL's signature "
            "(prompt, completions, prompt_ids, completion_ids, **data)"
        },
    )
    max_turns: int = field(default=3, metadata={"help": "turns of the reflection / multiturn workflows"})
    turn_discount: float = field(default=0.9, metadata={"help": "per-turn discount of the multi-turn workflows"})
    system_prompt: Optional[str] = field(default=None, metadata={"help": "system message put before each question"})
    skip_silent_rows: bool = field(
        default=True,
        metadata={
            "help": "the update skips rows whose advantages are all zero (the same step for less work); false "
            "computes every row, so that timed runs do equal work whatever the rewards (notebook 07)"
        },
    )


# ------------------------------------------------------------------------------------------------ building blocks


def resolve_reward(name: str, dataset_type: str) -> Callable:
    """`gsm8k` (AReaL's math-verify check), `arith` (the final answer only: AReaL's check pays a restated "4 + 3"),
    `auto` (`arith` for the arithmetic datasets, else `gsm8k`) or `package.module:function`."""
    if name == "auto":
        name = "arith" if dataset_type in ("arith", "arithmetic", "products") else "gsm8k"
    if name in ("gsm8k", "math"):
        from areal_lite.reward.gsm8k import gsm8k_reward_fn

        return gsm8k_reward_fn
    if name == "arith":
        from areal_lite.reward.arithmetic import arithmetic_reward_fn

        return arithmetic_reward_fn
    if ":" not in name:
        raise ValueError(f"reward must be 'auto', 'gsm8k', 'arith' or 'module:function', got {name!r}")
    module, fn = name.split(":", 1)
    return getattr(importlib.import_module(module), fn)


def config_reward(config: GRPOConfig) -> Callable:
    """The reward `config` trains with: its `reward` resolved for its training data (`resolve_reward`). Everything
    that trains, evaluates or compares a config's run takes it from here, so that all score with the same function."""
    return resolve_reward(getattr(config, "reward", "auto"), config.train_dataset.type)


def build_workflow(config: GRPOConfig, tokenizer, reward_fn: Optional[Callable] = None):
    """The training workflow named by `config.workflow`, grouped by `gconfig.n_samples` (GRPO)."""
    from areal_lite.workflow.grouped import GroupedWorkflow
    from areal_lite.workflow.multi_turn_feedback import MultiTurnFeedbackWorkflow
    from areal_lite.workflow.reflection import ReflectionWorkflow
    from areal_lite.workflow.rlvr import RLVRWorkflow

    reward_fn = reward_fn or config_reward(config)
    kind = getattr(config, "workflow", "rlvr")
    g = config.gconfig.new(n_samples=1)
    system = getattr(config, "system_prompt", None)
    turns = {"turn_discount": getattr(config, "turn_discount", 1.0), "system_prompt": system}  # the multi-turn ones
    if kind == "rlvr":
        inner = RLVRWorkflow(reward_fn, g, tokenizer, system_prompt=system)
    elif kind == "reflection":
        inner = ReflectionWorkflow(reward_fn, g, tokenizer, max_turns=config.max_turns, **turns)
    elif kind == "multiturn":
        inner = MultiTurnFeedbackWorkflow(reward_fn, g, tokenizer, num_turns=config.max_turns, **turns)
    else:
        raise ValueError(f"workflow must be one of {WORKFLOWS}, got {kind!r}")
    return GroupedWorkflow(inner, group_size=config.gconfig.n_samples, sort_rows=True)  # reproducible: grouped.py


def build_eval_workflow(config: GRPOConfig, tokenizer, reward_fn: Optional[Callable] = None):
    """The held-out evaluation's workflow: one answer per problem under `eval_gconfig` (greedy in the configs), no
    group, scored with the run's reward (`config_reward`). Training and the benches that compare runs all take it
    from here."""
    from areal_lite.workflow.rlvr import RLVRWorkflow

    return RLVRWorkflow(
        reward_fn or config_reward(config),
        config.eval_gconfig.new(n_samples=1),
        tokenizer,
        system_prompt=getattr(config, "system_prompt", None),
    )


def evaluate(
    addrs: Sequence[str],
    rows: Sequence[dict],
    workflow: RolloutWorkflow,
    rollout: InferenceEngineConfig,
    version: int = 0,
) -> Dict[str, float]:
    """Accuracy (mean reward) and mean response length of `workflow` (e.g. a greedy RLVRWorkflow) on `rows`.

    Runs through a fresh engine client, so its episodes never count against a training engine's staleness bound.
    `version` is the servers' weight version (with `rollout.use_lora` the requests name that version's adapter).
    """
    if not rows:
        return {}
    batch = evaluation_batch(addrs, rows, workflow, rollout, version)
    return {
        "eval_accuracy": float(batch["rewards"].float().mean()),
        "eval_response_length": float(batch["loss_mask"].sum(-1).float().mean()),
    }


def evaluation_batch(
    addrs: Sequence[str],
    rows: Sequence[dict],
    workflow: RolloutWorkflow,
    rollout: InferenceEngineConfig,
    version: int = 0,
) -> Dict[str, torch.Tensor]:
    """`evaluate`'s episodes as one padded batch: every row at once, on a fresh client (bench/eval_cost.py counts
    their work from it)."""
    from areal_lite.engine.sglang_remote import RemoteSGLangEngine

    n = len(rows)
    cfg = dataclasses.replace(
        rollout, consumer_batch_size=n, max_concurrent_rollouts=n, max_head_offpolicyness=0, queue_size=None
    )
    engine = RemoteSGLangEngine(cfg).initialize(addr=list(addrs))
    engine.set_version(version)
    try:
        return concat_padded_tensors(engine.rollout_batch(list(rows), workflow))
    finally:
        engine.destroy()


def batch_stats(batch: Dict[str, torch.Tensor], version: int) -> Dict[str, float]:
    """Per-step numbers about the rollouts themselves."""
    rewards = batch["rewards"].float()
    gen = batch["loss_mask"].bool() & batch["attention_mask"].bool()
    versions = batch["versions"][gen]
    lag = (version - versions).float() if versions.numel() else torch.zeros(1)
    return {
        "reward": float(rewards.mean()),
        "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "accuracy": float((rewards > 0).float().mean()),  # fraction of episodes with a positive reward
        "response_length": float(gen.sum(-1).float().mean()),
        "seq_length": float(batch["attention_mask"].sum(-1).float().mean()),
        "n_episodes": float(rewards.numel()),
        "staleness_mean": float(lag.mean()),
        "staleness_max": float(lag.max()),
    }


def _fingerprint(rows: Sequence[dict]) -> str:
    text = json.dumps([r.get("question", r.get("messages", "")) for r in rows], sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:12]


class StatsLogger:
    """stats.jsonl (always), TensorBoard and wandb when configured and installed. A resumed run cuts stats.jsonl
    back to the steps before the checkpoint it continues from; a fresh run starts a fresh file."""

    def __init__(self, config: GRPOConfig, run_dir: str, resume_step: int):
        self.path = os.path.join(run_dir, "stats.jsonl")
        os.makedirs(run_dir, exist_ok=True)
        kept: List[dict] = []
        if resume_step > 0 and os.path.exists(self.path):
            from areal_lite.kit.notebook.plot import load_stats

            kept = [r for r in load_stats(self.path) if r.get("step", -1) < resume_step]
        elif os.path.exists(self.path):
            os.remove(self.path)  # a fresh run starts a fresh log
        if resume_step > 0:
            with open(self.path, "w", encoding="utf-8") as fh:
                fh.writelines(json.dumps(r) + "\n" for r in kept)
        self.history = kept
        self.tb = self.wandb = None
        if config.stats_logger.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))
            except ImportError:
                print("train: tensorboard is not installed; stats go to stats.jsonl only")
        if config.stats_logger.wandb_mode != "disabled":
            try:
                import wandb

                self.wandb = wandb.init(
                    project=config.experiment_name,
                    name=config.trial_name,
                    mode=config.stats_logger.wandb_mode,
                    config=dataclasses.asdict(config),
                    dir=run_dir,
                    resume="allow",
                )
            except ImportError:
                print("train: wandb is not installed; stats go to stats.jsonl only")

    def log(self, stats: Dict[str, Any]) -> None:
        self.history.append(stats)
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(stats) + "\n")
        step = int(stats["step"])
        numbers = {k: v for k, v in stats.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        if self.tb is not None:
            for k, v in numbers.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(numbers, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def save_checkpoint(
    ckpt_root: str,
    step: int,
    actor,
    dataloader,
    keep_last: int,
    run_id: Optional[str] = None,
    settings: Optional[Dict[str, Any]] = None,
) -> str:
    """actor + dataloader position + step + the run's id and `settings` (`config_settings`), in folder step_<step>,
    written whole or not at all (`atomic_dir`). In async mode the saved data position is the loader's, which runs
    ahead of the consumed batches by the rollouts in flight: a resumed run skips those prompts."""

    def fill(tmp: str) -> None:
        actor.save(os.path.join(tmp, "actor"))
        state = {"step": step, "dataloader": dataloader.state_dict(), "python_rng": random.getstate()}
        state["run_id"] = run_id  # `rundir`: a resumed run refuses another run's checkpoints
        state["settings"] = settings  # a resume reports what changed since (`report_changed_settings`)
        torch.save(state, os.path.join(tmp, TRAINER_STATE))

    final = atomic_dir(os.path.join(ckpt_root, f"step_{step:06d}"), fill)  # a re-saved step keeps its old copy
    steps = sorted(int(d[5:]) for d in os.listdir(ckpt_root) if d.startswith("step_"))
    for old in steps[: max(0, len(steps) - max(1, keep_last))]:
        shutil.rmtree(os.path.join(ckpt_root, f"step_{old:06d}"), ignore_errors=True)
    return final


def config_settings(config: Any) -> Dict[str, Any]:
    """`config` as {dotted key: value}: what a checkpoint records, so that a resume can say what changed."""
    flat: Dict[str, Any] = {}

    def walk(d: Dict[str, Any], prefix: str) -> None:
        for key, value in d.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                flat[prefix + key] = value

    walk(dataclasses.asdict(config), "")
    return flat


def report_changed_settings(saved: Optional[Dict[str, Any]], now: Dict[str, Any]) -> None:
    """Print the settings of a resumed run that differ from those its checkpoint was saved with (a checkpoint of an
    earlier version records none). A resume takes the new values, but not silently: a changed `seed`, say, changes
    the server's samples while the data order and Python's random state continue the checkpoint's."""
    if not saved:
        return
    changed = [f"{k}: {saved[k]!r} -> {now[k]!r}" for k in sorted(now) if k in saved and saved[k] != now[k]]
    if changed:
        print("train: settings that differ from the checkpoint's run: " + "; ".join(changed))


def _sync_weights(actor: FSDPPPOActor, engine: InferenceEngine, meta: WeightUpdateMeta, version: int) -> None:
    """Write version `version` and make the servers load it; both sides end at `version`.

    The versions are bumped *before* `resume()`, so every rollout started afterwards is tagged with the new one."""
    engine.pause()
    try:
        future = engine.update_weights(meta)  # waits for the folder ...
        actor.update_weights(meta)  # ... that the trainer writes now
        future.result()
        actor.set_version(version)
        engine.set_version(version)
    finally:
        engine.resume()


def _threads(config: GRPOConfig, own_server: bool) -> None:
    """On a small CPU machine the trainer and each server take one thread each (unless configured).

    Asynchronous training with the run's own CPU server: trainer and server compute at the same time, so their
    threads must fit the cores together. Past that, both OpenMP teams spin at each of their many small barriers on
    cores the other needs, and a run takes several times as long. Each side is then capped at its share (the
    trainer's first), and a line says so. Synchronous runs take turns: each side may use every core.
    """
    from areal_lite.utils.device import capped_threads, set_torch_threads
    from areal_lite.utils.machine import usable_cores

    cpus = usable_cores()
    if config.actor.threads == 0 and config.profile == "cpu" and cpus <= 4:
        config.actor.threads = max(1, cpus - config.embedded.threads)
    server = config.embedded
    on_cpu = config.profile == "cpu" and server_backend(config) in ("embedded", "auto")
    if config.async_training and own_server and on_cpu:
        asked = (capped_threads(config.actor.threads), capped_threads(server.threads))
        if min(asked) > 0 and sum(asked) > cpus:
            config.actor.threads = max(1, min(asked[0], cpus - cpus // 2))
            server.threads = max(1, min(asked[1], cpus - config.actor.threads))
            print(
                f"train: asynchronous training runs the trainer and its server at once: {asked[0]} + {asked[1]} "
                f"threads exceed the {cpus} cores, so actor.threads={config.actor.threads} and "
                f"embedded.threads={server.threads}",
                flush=True,
            )
    set_torch_threads(config.actor.threads)


# ------------------------------------------------------------------------------------------------ the loop


@dataclasses.dataclass
class _RunData:
    """What a run reads before it starts: tokenizer, the training loader, held-out rows and the step budget."""

    tokenizer: PreTrainedTokenizerBase
    dataloader: StatefulDataLoader
    valid_rows: List[dict]
    ft_spec: FinetuneSpec
    total: int


def _load_run_data(config: GRPOConfig) -> _RunData:
    from areal_lite.dataset.loader import load_dataset_from_config
    from areal_lite.utils.dataloader import make_dataloader
    from areal_lite.utils.model_store import load_tokenizer

    tokenizer = load_tokenizer(config.tokenizer_path or config.actor.path)
    ds = config.train_dataset
    train_set = load_dataset_from_config(ds)
    dataloader = make_dataloader(train_set, ds.batch_size, shuffle=ds.shuffle, seed=ds.seed, drop_last=ds.drop_last)
    valid_rows: List[dict] = []
    if config.valid_dataset is not None:
        valid = load_dataset_from_config(config.valid_dataset)
        valid_rows = [valid[i] for i in range(min(len(valid), config.evaluator.size))]
    ft_spec = FinetuneSpec(config.total_train_epochs, len(train_set), ds.batch_size)
    total = ft_spec.total_train_steps
    if config.total_train_steps is not None:
        # An explicit step count wins (the loader cycles over epochs); the LR schedule spans exactly those steps.
        total = int(config.total_train_steps)
        ft_spec = FinetuneSpec(1, total * ds.batch_size, ds.batch_size)
    return _RunData(tokenizer, dataloader, valid_rows, ft_spec, total)


def _start_weights(
    run: RunDir,
    launched: bool,
    actor: FSDPPPOActor,
    engine: InferenceEngine,
    dataloader: StatefulDataLoader,
    meta: WeightUpdateMeta,
) -> int:
    """Restore the run's checkpoint (when continuing a run) or adopt running servers; returns the first step to run.

    With LoRA the servers load each version's adapter as `<gconfig.lora_name>-v<k>`. A fresh run syncs version 0
    first, since the servers start without the adapter; checkpoints hold the adapter, so a resume pushes it back;
    servers the run did not start first get the base model (`_load_base_model`)."""
    if not launched and actor.config.use_lora:
        _load_base_model(actor, engine)
    ckpt, state = run.checkpoint, run.state
    if ckpt is not None:
        try:
            actor.load(os.path.join(ckpt, "actor"))
        except (OSError, RuntimeError) as e:  # a file missing or truncated, or another actor.path than the run's
            if "size mismatch" in str(e):
                why = f"checkpoint {ckpt} holds another model's weights than actor.path={actor.config.path}"
                raise RunDirError(f"{why}: resume with the run's own model, or start a fresh trial_name=") from None
            raise RunDirError(damaged(ckpt, e)) from None
        dataloader.load_state_dict(state["dataloader"])
        random.setstate(state["python_rng"])
        start = int(state["step"])
        # The servers start from the base weights: give them the checkpoint's (as version `start`).
        actor.set_version(start - 1)
        engine.set_version(start - 1)
        _sync_weights(actor, engine, meta, start)
        print(f"train: resumed from {ckpt} at step {start}")
        kept, asked = actor.lr_scheduler.base_lrs[0], actor.config.optimizer.lr  # the checkpoint's schedule wins
        if not math.isclose(kept, asked):
            print(f"train: actor.optimizer.lr={asked:g} is not applied: the checkpoint's schedule keeps lr={kept:g}")
        return start
    if not launched or actor.config.use_lora:
        # Servers we did not start may hold other weights (an earlier run): give them ours, as version 0. With LoRA
        # the servers hold no adapter yet, and requests ask for `<lora_name>-v0` (AReaL preloads it at launch).
        actor.set_version(-1)
        engine.set_version(-1)
        _sync_weights(actor, engine, meta, 0)
    return 0


def _load_base_model(actor: FSDPPPOActor, engine: InferenceEngine) -> None:
    """Servers we did not start get the base model before any adapter. Why: a server merges an adapter into
    whatever it holds, and a server an earlier run trained holds that run's weights; a LoRA run never writes full
    weights itself, so without this it would sample from, and report behaviour log-probs of, another model."""
    from areal_lite.utils.model_store import local_model_dir

    folder = local_model_dir(actor.config.path)  # a hub id: the snapshot the actor loaded, not the id
    if folder is None:
        raise ModelPathError(f"actor.path {actor.config.path!r}: no local copy for the servers to load")
    base = WeightUpdateMeta(type="disk", path=folder, version=0)
    engine.pause()
    try:
        engine.update_weights(base).result()
    finally:
        engine.resume()


def grpo_step(
    config: GRPOConfig,
    step: int,
    engine: InferenceEngine,
    actor: FSDPPPOActor,
    meta: WeightUpdateMeta,
    dataloader: StatefulDataLoader,
    data_iter,
    workflow: RolloutWorkflow,
):
    """One step: rollouts, (proximal log-probs), advantages, PPO update, weight sync; timed in four phases.

    The loop notebook 07_async_vs_sync times, shown there as it is: one `perf_counter` around each of generate, logp,
    update (advantages and PPO update together) and weight_sync. Returns the step's stats and its start time. In
    async mode "generate" is only the time the trainer waited for data (generation otherwise overlaps training).
    """
    t_step = time.perf_counter()
    if config.async_training:
        batch = concat_padded_tensors(engine.prepare_batch(dataloader, workflow))
        fingerprint = None
    else:
        rows = next(data_iter)
        fingerprint = _fingerprint(rows)
        batch = concat_padded_tensors(engine.rollout_batch(rows, workflow))
    t_gen = time.perf_counter() - t_step
    stats: Dict[str, Any] = {"step": step, **batch_stats(batch, actor.get_version())}

    t = time.perf_counter()
    if config.actor.use_decoupled_loss and config.actor.ppo_n_minibatches > 1:
        # Several minibatches move the weights between steps, so the proximal log-probs need a pass of their own;
        # with one, ppo_update takes them from its own forward pass (one pass fewer, same numbers).
        batch["prox_logp"] = actor.compute_logp(batch)
    t_logp = time.perf_counter() - t
    t = time.perf_counter()
    adv = actor.compute_advantages(batch)
    train_stats = actor.ppo_update(batch)
    actor.step_lr_scheduler()
    t_update = time.perf_counter() - t
    t = time.perf_counter()
    _sync_weights(actor, engine, meta, step + 1)
    t_sync = time.perf_counter() - t

    stats.update({k: v for k, v in train_stats.items() if k != "update_time"})
    stats["kl_reward"] = adv["kl_reward"]
    stats["version"] = actor.get_version()
    stats["weight_sync_bytes"] = actor.last_sync_bytes  # with use_lora: the adapter only
    stats["data_fingerprint"] = fingerprint
    stats.update({"time/generate": t_gen, "time/logp": t_logp, "time/update": t_update, "time/weight_sync": t_sync})
    return stats, t_step


def train(
    config: GRPOConfig,
    resume: bool = False,
    workflow: Optional[RolloutWorkflow] = None,
    reward_fn: Optional[Callable] = None,
    server_addrs: Optional[Sequence[str]] = None,
    on_step: Optional[Callable[[int, Dict[str, Any]], None]] = None,
    progress: bool = True,
    existing: str = "new_trial",
) -> List[Dict[str, Any]]:
    """Run GRPO as configured; returns the per-step stats (also in stats.jsonl).

    `workflow` / `reward_fn` override the config's; `server_addrs` uses running servers instead of launching one;
    `on_step(step, stats)` is called after each step (raise in it to stop). `resume=True` (recover mode 'on')
    continues this run from its newest checkpoint; a fresh start on a folder that holds another run moves to the
    next free trial folder (`existing="new_trial"`) or refuses (`"refuse"`, the command line's choice): `rundir`.
    Greedy evaluation (`eval_gconfig`, `evaluator.size` rows of `valid_dataset`) runs at the start, every
    `evaluator.freq_steps` steps and at the end; a reward-curve PNG is saved at the end.
    One trainer process: the actor supports FSDP2 under torchrun, but this loop does not shard rollouts across ranks.
    """
    from areal_lite.engine.fsdp_engine import FSDPPPOActor
    from areal_lite.engine.sglang_remote import RemoteSGLangEngine
    from areal_lite.kit.server.launch import launch_server

    _refuse_cuda_settings_without_cuda(config)
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    _threads(config, own_server=server_addrs is None)
    reconcile_temperature(config.actor, config.gconfig)  # a config built in Python skipped the loader
    reconcile_lora(config)
    run, meta = _open_run(config, resume, existing)
    handle = engine = actor = logger = owned_rewards = None
    try:
        if server_addrs is None:
            # First: the server loads its model while this process loads the data, the reward pool and the trainer's
            # model, and is waited for only when the trainer is ready too.
            handle = launch_server(config, backend=config.backend, log_dir=os.path.join(run.path, "logs"))
        data = _load_run_data(config)
        reward_fn = reward_fn or config_reward(config)
        # One reward worker pool for the run, shared by training and evaluation, started now so that its start-up
        # overlaps the server's model load too: otherwise the first held-out evaluation pays for it.
        if isinstance(reward_fn, AsyncRewardWrapper):
            rewards = reward_fn
        else:
            rewards = owned_rewards = AsyncRewardWrapper(reward_fn)
        rewards.start_workers()
        workflow = workflow or build_workflow(config, data.tokenizer, rewards)
        eval_workflow = build_eval_workflow(config, data.tokenizer, rewards)
        actor = FSDPPPOActor(config.actor, ref_config=config.ref).initialize(None, data.ft_spec)
        if handle is not None:
            server_addrs = [handle.wait_ready(timeout=config.rollout.setup_timeout).address]
        server_addrs = list(server_addrs)
        engine = RemoteSGLangEngine(config.rollout).initialize(addr=server_addrs)
        actor.skip_silent_rows = getattr(config, "skip_silent_rows", True)
        start = _start_weights(run, handle is not None, actor, engine, data.dataloader, meta)
        logger = StatsLogger(config, run.path, start)

        def run_eval(step: int) -> Dict[str, float]:
            return _held_out_eval(config, server_addrs, data.valid_rows, eval_workflow, step, progress)

        loop = _Loop(config, run, engine, actor, meta, data, workflow, logger, rewards)
        loop.steps(start, run_eval, on_step, progress)
        _save_curve(config, logger.history, run.path)
        return logger.history
    finally:
        if logger is not None:
            logger.close()
        if engine is not None:
            engine.destroy()
        if actor is not None:
            actor.destroy()
        if owned_rewards is not None:
            owned_rewards.shutdown()
        if handle is not None:
            handle.stop()
        run.close()


def _refuse_cuda_settings_without_cuda(config: GRPOConfig) -> None:
    """Before anything starts: else SGLang fails, or the trainer fetches a GPU-sized model to train it on a CPU, or a
    device check stops the run after its server started."""
    if torch.cuda.is_available():
        return
    if getattr(config, "profile", "") == "gpu":
        raise ConfigError("profile=gpu, but torch finds no CUDA GPU here: run with profile=cpu, or profile=auto "
                          "(it picks by CUDA)")  # fmt: skip
    from areal_lite.utils.device import pick_device

    for section in ("actor", "embedded"):
        device = getattr(getattr(config, section, None), "device", "auto")
        try:
            pick_device(device)  # the one rule for device names; without CUDA it refuses exactly the cuda ones
        except RuntimeError:
            raise ConfigError(f"{section}.device={device}, but torch finds no CUDA GPU here: use auto or cpu") from None


def _open_run(config: GRPOConfig, resume: bool, existing: str) -> Tuple[RunDir, WeightUpdateMeta]:
    """The run folder, continued or fresh (`rundir`), and where the weight versions go, with room checked for them."""
    run = open_run_dir(config, resume=resume, existing=existing)
    try:
        meta = WeightUpdateMeta.from_disk(
            path=config.weight_update_dir or os.path.join(run.path, "weights"),
            # AReaL's trainer: adapter-only syncs with LoRA, the last eta + 2 versions kept loaded
            use_lora=config.actor.use_lora,
            lora_name=config.gconfig.lora_name or config.rollout.lora_name,
            lora_keep_versions=config.rollout.max_head_offpolicyness + 2,
        )
        versions = os.path.dirname(meta.path)  # where the versions go
        check_writable(versions, "weight_update_dir")
        _check_weight_room(config, versions, meta.keep_last)
        if run.checkpoint is not None:  # said now, before the server's start-up
            report_changed_settings(run.state.get("settings"), config_settings(config))
    except BaseException:
        run.close()
        raise
    if run.resume and run.checkpoint is None:
        print(f"train: no checkpoint of this run in {run.path} yet; it starts again from step 0")
    elif resume and not run.resume:
        print(f"train: --resume but no run to continue in {run.path}; starting a fresh run")
    return run, meta


def _check_weight_room(config: GRPOConfig, folder: str, keep_last: int) -> None:
    """Refuse to start (`NoRoomError`, one line) when `folder` cannot hold the versions a run keeps at its peak, each
    of `written_version_bytes`: `keep_last` of them; one more while a version is written, unless it writes over the
    one it prunes (`recycled_file`: full weights, not an adapter)."""
    from areal_lite.engine.fsdp_utils.weights import recycled_file  # torch.distributed: not at import

    per_version = written_version_bytes(config.actor.path, config.actor.dtype)
    if per_version is not None:
        n = keep_last if recycled_file(config.actor.use_lora) else keep_last + 1
        what = f"{n} weight version{'s' if n > 1 else ''} of {per_version / 2**20:.1f} MiB each"
        check_room(folder, n * per_version, what)


@dataclasses.dataclass
class _Loop:
    """The steps of one run, from `start` to the budget: step, checkpoint, evaluate, log."""

    config: GRPOConfig
    run: RunDir
    engine: InferenceEngine
    actor: FSDPPPOActor
    meta: WeightUpdateMeta
    data: _RunData
    workflow: RolloutWorkflow
    logger: StatsLogger
    rewards: AsyncRewardWrapper  # the run's reward pool: its failures are counted per step

    def _reward_failures(self, before: Dict[str, int]) -> Dict[str, float]:
        """Reward calls that timed out or raised since `before` (each scored 0.0): in stats.jsonl, not only a log."""
        now = self.rewards.stats
        return {f"reward_fn_{k}": float(now[k] - before[k]) for k in ("timeouts", "errors")}

    def save(self, step: int) -> None:
        ckpt_root = os.path.join(self.run.path, "checkpoints")
        loader, keep = self.data.dataloader, self.config.saver.keep_last
        save_checkpoint(ckpt_root, step, self.actor, loader, keep, self.run.run_id, config_settings(self.config))

    def steps(self, start: int, run_eval: Callable, on_step: Optional[Callable], progress: bool) -> None:
        from tqdm.auto import tqdm

        from areal_lite.utils.data import cycle_dataloader

        config, total = self.config, self.data.total
        if start and start >= total:  # a resumed run already at (or past) its budget: say so rather than run nothing
            print(f"train: the checkpoint is at step {start}, total_train_steps={total}: no step to run")
        pending_eval = run_eval(start) if start == 0 else {}
        data_iter = cycle_dataloader(self.data.dataloader)
        bar = tqdm(range(start, total), initial=start, total=total, desc="grpo", disable=not progress)
        for step in bar:
            failures_before = self.rewards.stats
            stats, t_step = grpo_step(
                config, step, self.engine, self.actor, self.meta, self.data.dataloader, data_iter, self.workflow
            )
            done = step + 1
            freq = config.evaluator.freq_steps
            if step == start and pending_eval:
                stats.update({k: v for k, v in pending_eval.items() if k != "eval_accuracy"})
                stats["eval_accuracy_before"] = pending_eval["eval_accuracy"]
            if done == total or (freq and done % freq == 0):
                stats.update(run_eval(done))
            stats.update(self._reward_failures(failures_before))
            stats["time/step"] = time.perf_counter() - t_step
            self.logger.log(stats)  # before the checkpoint: a run killed after it must not lose this step's line
            if config.saver.freq_steps and done % config.saver.freq_steps == 0 and done < total:
                self.save(done)
            bar.set_postfix(reward=f"{stats['reward']:.3f}", len=f"{stats['response_length']:.0f}")
            if on_step is not None:
                on_step(step, stats)
        if config.saver.freq_steps and total > start:
            self.save(total)


def _held_out_eval(
    config: GRPOConfig, addrs: List[str], rows: List[dict], workflow: RolloutWorkflow, step: int, progress: bool
):
    """Greedy accuracy on the held-out rows (nothing when there are none), with its wall time."""
    if not rows:
        return {}
    t = time.perf_counter()
    out = evaluate(addrs, rows, workflow, config.rollout, version=step)  # after step k's sync the servers hold k
    out["time/eval"] = time.perf_counter() - t
    if progress:
        print(f"train: step {step}: greedy accuracy {out['eval_accuracy']:.3f} on {len(rows)} held-out")
    return out


def _save_curve(config: GRPOConfig, history: List[Dict[str, Any]], run_dir: str) -> None:
    from areal_lite.kit.notebook.plot import plot_rewards, save_png

    if history:
        title = f"{config.experiment_name} reward"
        save_png(plot_rewards(history, title=title), os.path.join(run_dir, "reward_curve.png"))


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if {"-h", "--help"} & set(argv):
        try:
            print(USAGE)
            print(describe(TrainConfig), flush=True)  # every field with its one-line help
        except BrokenPipeError:  # `--help | head`: the reader left; Python's documented way to end quietly
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    resume = "--resume" in argv
    argv = [a for a in argv if a != "--resume"]
    for arg in argv:  # the loader knows --config only; --resum earns a hint here
        if arg.startswith("-") and arg != "--config" and not arg.startswith("--config="):
            near = difflib.get_close_matches(arg, ["--config", "--resume", "--help"], n=1, cutoff=0.6)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            print(f"train: command line: unknown option '{arg}'{hint} (see --help)", file=sys.stderr)
            return 2
    if not any(a == "--config" or a.startswith("--config=") for a in argv):  # no file: no model, data or reward
        print("train: --config FILE is needed (e.g. configs/arith_grpo_demo.yaml); see --help", file=sys.stderr)
        return 2
    try:
        config, path = load_expr_config(argv, TrainConfig)
        stats = train(config, resume=resume, existing="refuse")
    except ONE_LINE_ERRORS as e:
        print(f"train: {e}", file=sys.stderr)  # one line, no traceback: the message says what to do
        return 2
    if stats:
        first, last = stats[0], stats[-1]
        print(f"train: {len(stats)} steps logged; reward {first['reward']:.3f} -> {last['reward']:.3f}")
        if "eval_accuracy_before" in first and "eval_accuracy" in last:
            print(f"train: greedy accuracy {first['eval_accuracy_before']:.3f} -> {last['eval_accuracy']:.3f}")
        run_dir = os.path.join(config.fileroot, config.experiment_name, config.trial_name)
        print(
            f"train: stats in {os.path.join(run_dir, 'stats.jsonl')}, "
            f"curve in {os.path.join(run_dir, 'reward_curve.png')}"
        )
    else:  # total_train_steps=0 (an evaluation of the start), or a resumed run that had finished
        print(f"train: no training step ran (total_train_steps={config.total_train_steps})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
