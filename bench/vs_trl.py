"""The kit against TRL's `GRPOTrainer` on the demo's task: train time per run, the ratio, and both accuracy gains.

    make bench-trl                                           # make trl first (TRL's own venv), then this, 3 x 16
    PYTHONPATH=. .venv/bin/python bench/vs_trl.py [--repeats 3] [--steps 16] [--threads 2] [--bf16]
        [--trl-python .venv-trl/bin/python] [--out bench/results/vs_trl.json]   (`--help`: every option)

The workload is `make demo` (`configs/arith_grpo_demo.yaml`). Runs alternate, kit then TRL, `--repeats` times, each
a fresh child process: the kit's `kit.trainer.demo` (its embedded server and trainer taking turns on the cores), and
`bench/_trl_grpo.py` in TRL's venv (transformers' `generate`, then TRL's update: `loss_type="dapo"`, `beta=0`,
`scale_rewards="group"`, 32 completions per optimizer step, the kit's AdamW). docs/trl.md says what is held equal,
what differs by design, and how time and CPU are counted.

Design decisions
- Same data, reward and evaluator: the kit's batches go to TRL as messages with the kit's prompt ids, which TRL's side
  checks, and both sides abort when a step's data fingerprint differs; TRL scores with the kit's reward function, and
  both trained models (and the base model) are scored by the kit's greedy evaluator in a child process.
- Hyperparameters are read from the kit's config and mapped onto `trl.GRPOConfig`; a config the mapping cannot
  express (a KL term, another schedule, several minibatches, LoRA) is refused rather than compared unequal.
- Train time is the sum of the steps' wall times, evaluation and set-up left out; both sides are seeded, so a repeat
  replays the same samples and the repeats measure the spread of the time, not of what is learnt.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from _format import median_range  # noqa: E402

TRL_SCRIPT = os.path.join(ROOT, "bench", "_trl_grpo.py")
EXPERIMENT = "bench-vs-trl"
# The kit's config may not come from the environment here: this script and its children must load the same one.
CONFIG_ENV = ("AREAL_LITE_OVERRIDES", "AREAL_LITE_PROFILE")


# ------------------------------------------------------------------------------------------------ the kit's config


def overrides(args) -> list[str]:
    # evaluator.freq_steps=0: held-out accuracy only before and after, as on TRL's side (the demo also evaluates
    # half-way, which would run inside a step's clock)
    # --bf16: actor.dtype=bfloat16, the kit's precision plan: bf16 autocast where this CPU measures it faster; and
    # embedded.dtype=auto, the server's: bf16 weights where this CPU measures them faster and batch-exact
    precision = ["actor.dtype=bfloat16", "embedded.dtype=auto"] if args.bf16 else ["actor.dtype=float32"]
    return [f"total_train_steps={args.steps}", f"actor.threads={args.threads}", f"embedded.threads={args.threads}",
            "evaluator.freq_steps=0", *precision]  # fmt: skip


def load_config(args):
    from areal_lite.api.cli_args import load_expr_config, reconcile_temperature
    from areal_lite.kit.trainer.demo import config_path
    from areal_lite.kit.trainer.train import TrainConfig

    config, _ = load_expr_config(["--config", config_path(), *overrides(args)], TrainConfig, verbose=False)
    reconcile_temperature(config.actor, config.gconfig)
    return config


def trl_hyperparameters(config) -> dict:
    """The kit config's training choices as the fields `_trl_grpo.py` maps onto `trl.GRPOConfig`; refuses a config
    that mapping cannot express."""
    a, g, opt = config.actor, config.gconfig, config.actor.optimizer
    norm = a.reward_norm
    wanted = {
        "workflow": (config.workflow, "rlvr"),
        "async_training": (config.async_training, False),
        "actor.kl_ctl": (a.kl_ctl, 0.0),
        "actor.reward_norm levels": ((norm.mean_level, norm.std_level) if norm else None, ("group", "group")),
        "actor.adv_norm": (a.adv_norm, None),
        "actor.ppo_n_minibatches": (a.ppo_n_minibatches, 1),
        "actor.use_lora": (a.use_lora, False),
        "actor.dtype in (float32, bfloat16)": (a.dtype in ("float32", "bfloat16"), True),
        "actor.optimizer.type": (opt.type, "adam"),
        "actor.optimizer.lr_scheduler_type": (opt.lr_scheduler_type, "constant"),
        "actor.optimizer.warmup_steps_proportion": (opt.warmup_steps_proportion, 0.0),
        "actor.reward_scaling, reward_bias": ((a.reward_scaling, a.reward_bias), (1.0, 0.0)),
        "actor.mask_no_eos_with_zero": (a.mask_no_eos_with_zero, False),
        "actor.temperature": (a.temperature, g.temperature),
        "gconfig.greedy": (g.greedy, False),
        "gconfig.min_new_tokens": (g.min_new_tokens, 0),
        "gconfig.top_k (all tokens)": (g.top_k >= int(1e8) or g.top_k <= 0, True),
        "gconfig.frequency_penalty": (g.frequency_penalty, 0.0),
        "gconfig.stop": (g.stop or None, None),
    }
    bad = [f"{k}={got!r} (needs {want!r})" for k, (got, want) in wanted.items() if got != want]
    if bad:
        raise SystemExit("vs_trl: the kit config has choices the TRL run cannot match: " + "; ".join(bad))
    return {
        "n_samples": g.n_samples,
        "batch_size": config.train_dataset.batch_size,
        "max_new_tokens": g.max_new_tokens,
        "temperature": g.temperature,
        "top_p": g.top_p,
        "eps_clip": a.eps_clip,
        "lr": opt.lr,
        "beta1": opt.beta1,
        "beta2": opt.beta2,
        "adam_eps": opt.eps,
        "weight_decay": opt.weight_decay,
        "gradient_clipping": opt.gradient_clipping,
        "bf16": a.dtype == "bfloat16",  # TRL's bf16 (its default; autocast on a CPU), the kit's precision plan
    }


def export_data(config, steps: int) -> tuple[list[dict], list[str], str]:
    """The kit's first `steps` training batches, in its dataloader's order, as rows for TRL (chat messages, the
    kit's prompt ids, the answer); each batch's data fingerprint (as the kit's stats log it); the reward's name."""
    from areal_lite.kit.trainer.train import _fingerprint, _load_run_data, build_workflow, config_reward
    from areal_lite.utils.data import cycle_dataloader
    from areal_lite.utils.hf_utils import chat_prompt_ids

    data = _load_run_data(config)
    reward_fn = config_reward(config)
    inner = build_workflow(config, data.tokenizer, reward_fn).workflow  # the RLVRWorkflow inside the group
    batches, it = [], cycle_dataloader(data.dataloader)
    for _ in range(steps):
        batches.append(next(it))
    rows = []
    for batch in batches:
        for row in batch:
            messages = list(inner.data_extract_prompt_fn(row))
            if inner.system_prompt is not None and not (messages and messages[0].get("role") == "system"):
                messages = [{"role": "system", "content": inner.system_prompt}] + messages
            ids = [int(i) for i in inner.prompt_ids(row)]
            if chat_prompt_ids(data.tokenizer, messages) != ids:
                raise SystemExit(f"vs_trl: the exported messages do not give the kit's prompt ids for {row}")
            rows.append({"messages": messages, "prompt_ids": ids, "answer": row["answer"]})
    reward = f"{reward_fn.__module__}:{reward_fn.__qualname__}"
    return rows, [_fingerprint(b) for b in batches], reward


# ------------------------------------------------------------------------------------------------ child processes


def run_child(cmd: list[str], log_path: str, env: dict) -> dict:
    """Run `cmd` to its end with output to `log_path`; its wall time and its process tree's CPU seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if rc != 0:
        with open(log_path, encoding="utf-8", errors="replace") as fh:
            tail = fh.read()[-4000:]
        raise SystemExit(f"vs_trl: {' '.join(cmd[:4])} ... failed (exit {rc}); {log_path} ends:\n{tail}")
    return {
        "wall_s": wall,
        "cpu_user_s": after.ru_utime - before.ru_utime,
        "cpu_sys_s": after.ru_stime - before.ru_stime,
    }


def child_env(threads: int, kit_path: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in CONFIG_ENV}
    env.update(OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    if kit_path:
        env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    else:
        env.pop("PYTHONPATH", None)  # TRL's side imports the kit's reward from the checkout itself, nothing else
    return env


def run_kit(args, root: str, index: int, fingerprints: list[str]) -> dict:
    trial = f"kit-{os.getpid()}-{index}"
    cmd = [sys.executable, "-m", "areal_lite.kit.trainer.demo", *overrides(args), f"fileroot={root}",
           f"experiment_name={EXPERIMENT}", f"trial_name={trial}"]  # fmt: skip
    log = os.path.join(root, f"{trial}.log")
    proc = run_child(cmd, log, child_env(args.threads, kit_path=True))
    with open(log) as f:  # with --bf16, the actor's one line saying whether it autocasts here, and why
        precision = next((line.strip() for line in f if line.startswith("areal-lite: actor.dtype=")), "float32")
    from areal_lite.kit.notebook.plot import load_stats

    stats = load_stats(os.path.join(root, EXPERIMENT, trial, "stats.jsonl"))
    if len(stats) != args.steps:
        raise SystemExit(f"vs_trl: the kit run logged {len(stats)} steps, not {args.steps}")
    logged = [s.get("data_fingerprint") for s in stats]
    if logged != fingerprints:
        raise SystemExit(f"vs_trl: the kit trained on other batches than exported: {logged} vs {fingerprints}")
    steps = [s["time/step"] for s in stats]
    eval_in_last = stats[-1].get("time/eval", 0.0)  # the final evaluation runs inside the last step's clock
    steps[-1] -= eval_in_last
    phases = {p: sum(s[f"time/{p}"] for s in stats) for p in ("generate", "logp", "update", "weight_sync")}
    phases["other"] = sum(steps) - sum(phases.values())
    return {
        "system": "kit",
        "repeat": index,
        "train_s": sum(steps),
        "step_s": steps,
        "phase_s": phases,
        "eval_s": [stats[0].get("time/eval"), eval_in_last] if args.steps > 1 else [None, eval_in_last],
        "accuracy_before": stats[0]["eval_accuracy_before"],
        "accuracy_after": stats[-1]["eval_accuracy"],
        "reward_by_step": [s["reward"] for s in stats],
        "response_length_by_step": [s["response_length"] for s in stats],
        "data_fingerprints": logged,
        "precision": precision,
        "server_dtype": served_dtype(os.path.join(root, EXPERIMENT, trial, "logs")),
        **proc,
    }


def served_dtype(log_dir: str) -> str:
    """The dtype the kit's server served, from its ready line in `log_dir` (what `embedded.dtype=auto` picked)."""
    for name in sorted(os.listdir(log_dir)):
        with open(os.path.join(log_dir, name), errors="replace") as f:
            for line in f:
                if "areal-lite serve: ready on" in line and " dtype=" in line:
                    return line.split(" dtype=", 1)[1].split()[0]
    raise SystemExit(f"vs_trl: no server ready line in {log_dir}")


def run_trl(args, root: str, index: int, spec: dict) -> dict:
    name = f"trl-{index}"
    spec = dict(spec, out_dir=os.path.join(root, name))
    spec_path, out_path = os.path.join(root, f"{name}-spec.json"), os.path.join(root, f"{name}-out.json")
    with open(spec_path, "w", encoding="utf-8") as fh:
        json.dump(spec, fh)
    cmd = [args.trl_python, TRL_SCRIPT, spec_path, out_path]
    env = child_env(args.threads, kit_path=False)
    if args.trl_keep_freed:  # the kit's `keep_freed_memory`, from the start of TRL's process
        from areal_lite.utils.device import KEEP_FREED_TUNABLES

        env["GLIBC_TUNABLES"] = KEEP_FREED_TUNABLES
    proc = run_child(cmd, os.path.join(root, f"{name}.log"), env)
    with open(out_path, encoding="utf-8") as fh:
        out = json.load(fh)
    ph = out["phase_s"]
    phases = {"generate": sum(ph["generate"]), "reward": sum(ph["score"])}
    phases["rollout_other"] = sum(ph["rollout"]) - phases["generate"] - phases["reward"]
    phases["update"] = sum(s - r for s, r in zip(out["step_s"], ph["rollout"]))
    accuracy = evaluate_model(args, root, out["model_dir"], name)
    shutil.rmtree(out["model_dir"], ignore_errors=True)  # 0.5 GB per run; the numbers are kept
    return {
        "system": "trl",
        "repeat": index,
        "train_s": sum(out["step_s"]),
        "trainer_train_s": out["train_wall_s"],
        "step_s": out["step_s"],
        "phase_s": phases,
        "accuracy_after": accuracy["eval_accuracy"],
        "eval_after": accuracy,
        "reward_by_step": out["reward_by_step"],
        "response_length_by_step": out["completion_length_by_step"],
        "torch_threads": out["torch_threads"],
        "model_dtype": out["model_dtype"],
        "precision": f"{out['model_dtype']} weights, accelerate mixed_precision={out['mixed_precision']}",
        "optimizer": {"class": out["optimizer"], **out["optimizer_defaults"]},
        "versions": out["versions"],
        **proc,
    }


def evaluate_model(args, root: str, model_dir: str, name: str) -> dict:
    """Greedy held-out accuracy of the model in `model_dir` by the kit's evaluator, in a child process."""
    out = os.path.join(root, f"{name}-eval.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--threads", str(args.threads), "--steps", str(args.steps),
           "--eval-model", model_dir, "--eval-out", out, *(["--bf16"] if args.bf16 else [])]  # fmt: skip
    proc = run_child(cmd, os.path.join(root, f"{name}-eval.log"), child_env(args.threads, kit_path=True))
    with open(out, encoding="utf-8") as fh:
        return dict(json.load(fh), **{f"eval_{k}": v for k, v in proc.items()})


def eval_main(args) -> int:
    """`--eval-model DIR`: what `kit.trainer.train` does for its held-out evaluation, on the model in DIR: the embedded
    server on DIR, the evaluation workflow `train()` builds, `kit.trainer.train.evaluate` on the config's held-out
    rows."""
    from areal_lite.kit.server.launch import launch_server
    from areal_lite.kit.trainer.train import _load_run_data, build_eval_workflow, evaluate

    config = load_config(args)
    data = _load_run_data(config)
    workflow = build_eval_workflow(config, data.tokenizer)
    log_dir = os.path.join(os.path.dirname(os.path.abspath(args.eval_out)), "logs")
    handle = launch_server(config, backend=config.backend, log_dir=log_dir, model_path=args.eval_model)
    try:
        addr = handle.wait_ready(timeout=config.rollout.setup_timeout).address
        t = time.perf_counter()
        out = evaluate([addr], data.valid_rows, workflow, config.rollout)
        out["eval_s"] = time.perf_counter() - t
        out["n_problems"] = len(data.valid_rows)
    finally:
        handle.stop()
    out["server_dtype"] = served_dtype(log_dir)
    with open(args.eval_out, "w", encoding="utf-8") as fh:
        json.dump(out, fh)
    return 0


# ------------------------------------------------------------------------------------------------ the report


def summarise(runs: list[dict]) -> dict:
    kit = [r for r in runs if r["system"] == "kit"]
    trl = [r for r in runs if r["system"] == "trl"]
    ratios = [t["train_s"] / k["train_s"] for k, t in zip(kit, trl)]
    out = {"trl_over_kit_train_time": ratios, "trl_over_kit_median": statistics.median(ratios)}
    for name, rs in (("kit", kit), ("trl", trl)):
        out[name] = {
            "train_s_median": statistics.median(r["train_s"] for r in rs),
            "train_s_min": min(r["train_s"] for r in rs),
            "train_s_max": max(r["train_s"] for r in rs),
            "accuracy_after_median": statistics.median(r["accuracy_after"] for r in rs),
            "cpu_s_median": statistics.median(r["cpu_user_s"] + r["cpu_sys_s"] for r in rs),
        }
    return out


def print_report(result: dict) -> None:
    runs, s = result["runs"], result["summary"]
    kit = [r for r in runs if r["system"] == "kit"]
    trl = [r for r in runs if r["system"] == "trl"]
    steps = result["steps"]
    print()
    shape = f"{steps} steps of {result['prompts_per_step']} prompts x {result['group_size']}"
    machine = f"CPU {result['cpu_model']}, {result['vector_isa']} ({result['cores']} cores)"
    print(f"kit vs TRL GRPOTrainer: {shape}, {result['threads']} threads, {len(kit)} repeat(s); {machine}")
    if result.get("trl_keep_freed"):
        print("TRL's process kept freed memory as the kit's do (--trl-keep-freed)")
    print(
        f"{'run':8s} {'train s':>8s} {'s/step':>7s} {'proc wall':>9s} {'CPU s':>7s} {'held-out acc':>13s}  phases (s)"
    )
    for k, t in zip(kit, trl):
        for r in (k, t):
            before = r["accuracy_before"]
            phases = ", ".join(f"{p} {v:.1f}" for p, v in r["phase_s"].items())
            print(
                f"{r['system']} #{r['repeat']}   {r['train_s']:8.1f} {r['train_s'] / steps:7.2f} {r['wall_s']:9.1f} "
                f"{r['cpu_user_s'] + r['cpu_sys_s']:7.0f} {before:5.2f} -> {r['accuracy_after']:4.2f}  {phases}"
            )
        host = ", ".join(f"{r['host_mm_gflops']:.0f}" for r in (k, t) if "host_mm_gflops" in r)
        host = f" (a large float32 torch.mm before each run: {host} GFLOP/s)" if host else ""
        print(f"         TRL / kit train time: {t['train_s'] / k['train_s']:.2f}x{host}")
    print()
    for name, rs in (("kit", kit), ("TRL", trl)):
        gains = [r["accuracy_after"] - r["accuracy_before"] for r in rs]
        cpu = [r["cpu_user_s"] + r["cpu_sys_s"] for r in rs]
        print(
            f"{name:4s} train time {median_range([r['train_s'] for r in rs])} s, held-out accuracy after "
            f"{median_range([r['accuracy_after'] for r in rs], '{:.2f}')} (gain {median_range(gains, '{:+.2f}')}), "
            f"CPU {median_range(cpu, '{:.0f}')} s"
        )
    ratios = s["trl_over_kit_train_time"]
    print(f"TRL / kit train time: median {median_range(ratios, '{:.2f}')}x, per repeat {[round(x, 2) for x in ratios]}")
    print(f"TRL trainer.train() wall: {median_range([r['trainer_train_s'] for r in trl])} s (steps plus its set-up)")
    print(f"both accuracies by the kit's evaluator (greedy, {result['n_held_out']} held-out problems); "
          f"base model: {result['base_accuracy']:.2f}; prompt ids equal: {result['prompt_ids_equal']}")  # fmt: skip


# ------------------------------------------------------------------------------------------------ main


def parse_args() -> argparse.Namespace:
    """The command line (the module docstring is its help)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of each side (the kit: trainer and server)")
    ap.add_argument("--trl-python", default=os.path.join(ROOT, ".venv-trl", "bin", "python"))
    ap.add_argument("--out", help="results file (default bench/results/vs_trl.json, with --bf16 vs_trl_bf16.json)")
    ap.add_argument("--keep", action="store_true", help="keep the temp folder (logs, stats, specs)")
    ap.add_argument(
        "--trl-keep-freed",
        action="store_true",
        help="TRL's process keeps freed memory as the kit's "
        "trainer and server do (glibc tunables; default: TRL as installed)",
    )
    ap.add_argument(
        "--bf16",
        action="store_true",
        help="both sides in bf16: TRL with bf16=True (its default), the kit with actor.dtype=bfloat16 (autocast "
        "where this CPU measured it faster; it prints its choice) and embedded.dtype=auto. Default: float32",
    )
    ap.add_argument("--eval-model", help=argparse.SUPPRESS)  # internal: evaluate a model folder (eval_main)
    ap.add_argument("--eval-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.out = args.out or os.path.join(ROOT, "bench", "results", "vs_trl_bf16.json" if args.bf16 else "vs_trl.json")
    return args


def trl_spec(args, config, rows: list[dict], reward: str) -> dict:
    """What `_trl_grpo.py` is given: the model, the reward, the seed, the hyperparameters and the exported rows."""
    from areal_lite.utils.model_store import resolve_model_path

    return {
        "model_path": resolve_model_path(config.actor.path),
        "reward": reward,
        "threads": args.threads,
        "seed": config.seed,
        "steps": args.steps,
        "hyper": trl_hyperparameters(config),
        "train": rows,
    }


def run_repeats(args, root: str, spec: dict, fingerprints: list[str]) -> tuple[dict, list[dict]]:
    """The base model's held-out accuracy, then `--repeats` x (kit, TRL): (the base's evaluation, the runs)."""
    base = evaluate_model(args, root, spec["model_path"], "base")
    print(f"vs_trl: base model held-out accuracy {base['eval_accuracy']:.2f} (the kit's evaluator)")
    from _limit import measure_peak_gflops

    def measured(name: str, i: int, run) -> dict:
        # The machine's matmul speed just before each run: a shared host's moves by tens of percent within an hour,
        # and both sides' times (not always alike) with it; the record then shows what the machine was doing.
        host = measure_peak_gflops(args.threads, seconds=1.0)
        result = dict(run(), host_mm_gflops=host)
        result.setdefault("accuracy_before", base["eval_accuracy"])  # TRL's run starts from the base model
        print(f"vs_trl: {name} #{i}: {result['train_s']:.1f} s, accuracy {result['accuracy_before']:.2f} -> "
              f"{result['accuracy_after']:.2f} (torch.mm before: {host:.0f} GFLOP/s)")  # fmt: skip
        return result

    runs = []
    for i in range(args.repeats):  # alternating, so drift in the machine's load hits both alike
        runs.append(measured("kit", i, functools.partial(run_kit, args, root, i, fingerprints)))
        runs.append(measured("TRL", i, functools.partial(run_trl, args, root, i, spec)))
    return base, runs


def build_result(args, config, spec: dict, base: dict, runs: list[dict]) -> dict:
    """What `--out` gets: the machine, the settings both sides ran with, every run and their summary."""
    import importlib.metadata as md

    from _machine import describe, git_state

    source = git_state(ROOT)
    result = {
        "bench": "vs_trl",
        "commit": source["commit"] + ("-dirty" if source["dirty"] else ""),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        **describe(),  # cpu_model, cores (this process may use), vector_isa
        "cpu_count": os.cpu_count(),
        "threads": args.threads,
        "kit_threads": {"actor": config.actor.threads, "embedded_server": config.embedded.threads},
        "trl_keep_freed": args.trl_keep_freed,  # TRL's process with the kit's malloc settings (else as installed)
        "steps": args.steps,
        "repeats": args.repeats,
        "prompts_per_step": config.train_dataset.batch_size,
        "group_size": config.gconfig.n_samples,
        "n_held_out": base["n_problems"],
        "base_accuracy": base["eval_accuracy"],
        "prompt_ids_equal": True,  # checked on both sides (the runs abort otherwise)
        "prompt_token_ids_example": spec["train"][0]["prompt_ids"],
        "reward": spec["reward"],
        "hyperparameters": spec["hyper"],
        "kit_versions": {n: md.version(n) for n in ("torch", "transformers")},
        "runs": runs,
    }
    result["summary"] = summarise(runs)
    return result


def main() -> int:
    args = parse_args()
    for name in CONFIG_ENV:
        if os.environ.pop(name, None) is not None:
            print(f"vs_trl: ignoring ${name}: both runs use configs/arith_grpo_demo.yaml as it is")
    if args.eval_model:
        return eval_main(args)
    if args.steps < 1 or args.repeats < 1:
        raise SystemExit("vs_trl: --steps and --repeats must be at least 1")
    if not os.path.exists(args.trl_python):
        raise SystemExit(f"vs_trl: {args.trl_python} not found: run `make trl` first (TRL's own venv)")

    config = load_config(args)
    rows, fingerprints, reward = export_data(config, args.steps)
    spec = trl_spec(args, config, rows, reward)
    root = tempfile.mkdtemp(prefix="vs-trl-")
    print(f"vs_trl: {args.repeats} x (kit, TRL), {args.steps} steps each; logs in {root}")
    with open(os.path.join(root, "data.json"), "w", encoding="utf-8") as fh:
        json.dump({"train": rows, "fingerprints": fingerprints, "reward": reward}, fh, indent=1)
    try:
        base, runs = run_repeats(args, root, spec, fingerprints)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    result = build_result(args, config, spec, base, runs)
    print_report(result)
    from _machine import write_json

    write_json(args.out, result)
    print(f"vs_trl: results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
