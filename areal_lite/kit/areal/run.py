"""Train notebook 08_to_areal's exported experiment with AReaL 1.0.4's own trainer on this CPU: `make areal-run`.

    python -m areal_lite.kit.areal.run [--export runs/areal_export] [--steps 2] [--no-resume]

Design decisions
- What runs is the export, unchanged: `search_agent_areal.py` (notebook 05_search_agent's agent cells with AReaL
  imports, and a `main` that calls AReaL's `PPOTrainer`) with `search_agent_cpu.yaml` (the kit's CPU profile,
  converted by `to_areal_config`). AReaL's code is not patched; every CPU difference is a command-line override,
  each with its reason (`cpu_overrides`).
- AReaL is started the way its own local launcher starts a trainer next to servers that are already up: `torchrun`
  with `AREAL_SPMD_MODE=1` and `AREAL_LLM_SERVER_ADDRS`. `scheduler.type=local` would have AReaL launch SGLang
  itself, which needs CUDA; here the kit's embedded server stands in for SGLang (AReaL's `RemoteSGLangEngine` talks
  to it over SGLang's HTTP API), and the RAG server answers the agent's searches.
- The exported workflow asks for one sample per request (`gconfig.new(n_samples=1)`): AReaL's trainer groups the n
  samples itself and its engine refuses `n_samples > 1` in `agenerate`.
- Recovery is AReaL's own: `recover.mode=on` with a checkpoint every step; the second run asks for one more step
  and must start where the first stopped.
- Statistics are read from AReaL's printed per-step table (the one thing it prints for every step).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from typing import Dict, List, Optional

__all__ = ["cpu_overrides", "parse_steps", "run_exported", "run_all", "main"]

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_DONE = re.compile(r"Train step (\d+)/(\d+) done")
_CELL = re.compile(r"│\s*([A-Za-z0-9_/@.\-]+)\s*│\s*(-?[0-9.]+(?:e[+-]?\d+)?)\s*(?=│)")
SHOWN = {"reward": "ppo_actor/task_reward/avg", "loss": "ppo_actor/update/actor_loss/avg",
         "step_s": "timeperf/train_step"}  # fmt: skip


def cpu_overrides(model_path: str, rows_per_step: int, fileroot: str, steps: int) -> List[str]:
    """AReaL command-line overrides for this CPU, each with its reason. The seams:
    1. AReaL's FSDP actor hands the model a per-layer-type attention-mask dict, which Qwen-family models take and
       Llama models (SmolLM2) reject: the run uses SmolLM2's weights in Qwen2's layout (`as_qwen2_layout`, same
       logits).
    2. flash-attention is CUDA-only: `attn_impl=sdpa`.
    3. NCCL is GPU-only: `weight_update_mode=disk`.
    4. On CPU, AReaL packs a micro-batch's rows into one sequence and sdpa lets later rows attend to earlier ones
       (tests/test_areal_maths.py): `mb_spec.n_mbs` = rows per step puts each row in a micro-batch of its own.
    """
    return [
        f"++actor.path={model_path}",  # seam 1: Qwen2 layout
        f"++tokenizer_path={model_path}",
        "++actor.attn_impl=sdpa",  # seam 2: no flash-attention on CPU
        "++actor.weight_update_mode=disk",  # seam 3: no NCCL on CPU
        f"++actor.mb_spec.n_mbs={rows_per_step}",  # seam 4: one row per micro-batch
        f"++cluster.fileroot={fileroot}",
        # AReaL's name records (e.g. "weights of version k are on disk") live under the run, cleared before it:
        # a stale record from an earlier run would make the server load weights that are not written yet.
        f"++cluster.name_resolve.nfs_record_root={os.path.join(fileroot, 'name_resolve')}",
        f"++total_train_steps={steps}",
        "++recover.mode=on",  # AReaL's own recovery, a checkpoint every step
        "++recover.freq_steps=1",
    ]


def parse_steps(log: str) -> Dict[int, Dict[str, float]]:
    """{global step: {stat: value}} from AReaL's printed per-step tables."""
    text = _ANSI.sub("", log)
    marks = list(_DONE.finditer(text))
    steps: Dict[int, Dict[str, float]] = {}
    for i, m in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
        steps[int(m.group(1))] = {k: float(v) for k, v in _CELL.findall(text[m.end() : end])}
    return steps


def _rows_per_step(config_path: str) -> int:
    import yaml

    with open(config_path, encoding="utf-8") as fh:
        cfg = yaml.safe_load(fh)
    return int(cfg["train_dataset"]["batch_size"]) * int(cfg["gconfig"]["n_samples"])


def run_exported(
    export: str, model: str, steps: int, addrs: Dict[str, str], log_path: str, fresh: bool = True
) -> tuple[int, str, float]:
    """One `torchrun` of the exported script under AReaL (SPMD mode) on `model` (the Qwen2 layout the server also
    serves); returns (exit code, log text, seconds). `fresh`: start from nothing, else resume from the recovery
    checkpoint an earlier run left (AReaL's `recover.mode=on` finds it in the run's folder)."""
    from areal_lite.kit.server.procs import find_free_port

    config = os.path.join(export, "search_agent_cpu.yaml")
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nnodes", "1", "--nproc-per-node", "1",
           "--master-addr", "localhost", "--master-port", str(find_free_port()),
           "search_agent_areal.py", "--config", config,
           *cpu_overrides(model, _rows_per_step(config), os.path.join(export, "areal_run"), steps)]  # fmt: skip
    env = dict(os.environ, AREAL_SPMD_MODE="1", AREAL_LLM_SERVER_ADDRS=addrs["server"], RAG_ADDR=addrs["rag"],
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")  # fmt: skip
    # AReaL's name records of a finished run must go either way; a fresh run also drops its checkpoints, which AReaL
    # would otherwise resume from (a second `make areal-run` would then have no step left to train).
    shutil.rmtree(os.path.join(export, "areal_run", *([] if fresh else ["name_resolve"])), ignore_errors=True)
    start = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        code = subprocess.run(cmd, cwd=export, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    with open(log_path, encoding="utf-8", errors="replace") as fh:
        return code, fh.read(), time.perf_counter() - start


def _print_steps(steps: Dict[int, Dict[str, float]]) -> None:
    print("  step  " + "  ".join(f"{k:>8}" for k in SHOWN))
    for step, stats in sorted(steps.items()):
        print(f"  {step:4d}  " + "  ".join(f"{stats.get(v, float('nan')):8.3f}" for v in SHOWN.values()))


def _tail(log: str, n: int = 40) -> str:
    return "\n".join(_ANSI.sub("", log).splitlines()[-n:])


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m areal_lite.kit.areal.run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--export", default="runs/areal_export", help="folder notebook 08 exported to")
    ap.add_argument("--steps", type=int, default=2, help="training steps of the first run")
    ap.add_argument("--no-resume", action="store_true", help="skip the second run that resumes from the checkpoint")
    args = ap.parse_args(argv)
    export = os.path.abspath(args.export)
    if not os.path.exists(os.path.join(export, "search_agent_areal.py")):
        print(f"areal-run: no export in {export}: run notebook 08 first (make areal-run does)")
        return 2
    code, _ = run_all(export, args.steps, resume=not args.no_resume)
    return code


def run_all(export: str, steps: int, resume: bool = True) -> tuple[int, List[dict]]:
    """The first run (`steps` steps), then the resumed one: (exit code, each run's {"what", "exit", "seconds",
    "steps": {step: AReaL's stats}}). Prints what `make areal-run` shows. bench/areal_run.py records it."""
    from areal_lite.api.cli_args import EmbeddedServerConfig
    from areal_lite.dataset.factbook import build_factbook_corpus
    from areal_lite.kit.rag import launch_rag_server
    from areal_lite.kit.server.launch import launch_server
    from areal_lite.utils.model_store import as_qwen2_layout

    model = as_qwen2_layout("smollm2-135m-instruct")
    plan = [(steps, "train"), *([(steps + 1, "resume")] if resume else [])]
    done: List[dict] = []
    with launch_rag_server(build_factbook_corpus()) as rag:
        server = launch_server(EmbeddedServerConfig(model_path=model, threads=1), backend="embedded")
        try:
            server.wait_ready()
            for total, what in plan:
                log_path = os.path.join(export, f"areal_run_{what}.log")
                addrs = {"server": server.address, "rag": rag.address}
                code, log, seconds = run_exported(export, model, total, addrs, log_path, fresh=what == "train")
                trained = parse_steps(log)
                done.append({"what": what, "exit": code, "seconds": seconds, "steps": trained})
                print(f"areal-run {what}: AReaL's PPOTrainer, exit {code}, {seconds:.0f} s, log {log_path}")
                _print_steps(trained)
                if code != 0 or total not in trained:
                    print(_tail(log))
                    return 1, done
                if what == "resume" and sorted(trained) != [total]:
                    print(f"areal-run: the resumed run trained steps {sorted(trained)}, expected only {total}")
                    return 1, done
        finally:
            server.stop()
    print("areal-run: done" + ("; the second run resumed from AReaL's own checkpoint" if resume else ""))
    return 0, done


if __name__ == "__main__":
    sys.exit(main())
