"""Every YAML in configs/ becomes an AReaL 1.0.4 config through `areal_lite.kit.areal.config` (the one documented
step), AReaL's own `load_expr_config` loads it, the shared values are the kit's, and nothing is dropped silently.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest
import yaml

from areal_lite.api.cli_args import load_expr_config
from areal_lite.kit.areal.config import to_areal_config
from areal_lite.kit.trainer.train import TrainConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
# Values a run depends on: (kit attribute path, AReaL attribute path)
SHARED = [
    ("seed", "seed"),
    ("experiment_name", "experiment_name"),
    ("trial_name", "trial_name"),
    ("gconfig.n_samples", "gconfig.n_samples"),
    ("gconfig.max_new_tokens", "gconfig.max_new_tokens"),
    ("gconfig.temperature", "gconfig.temperature"),
    ("gconfig.top_k", "gconfig.top_k"),
    ("gconfig.stop", "gconfig.stop"),
    ("train_dataset.batch_size", "train_dataset.batch_size"),
    ("rollout.max_head_offpolicyness", "rollout.max_head_offpolicyness"),
    ("rollout.consumer_batch_size", "rollout.consumer_batch_size"),
    ("actor.optimizer.lr", "actor.optimizer.lr"),
    ("actor.eps_clip", "actor.eps_clip"),
    ("actor.kl_ctl", "actor.kl_ctl"),
    ("actor.use_decoupled_loss", "actor.use_decoupled_loss"),
    ("actor.recompute_logprob", "actor.recompute_logprob"),
    ("actor.ppo_n_minibatches", "actor.ppo_n_minibatches"),
    ("actor.dtype", "actor.dtype"),
    ("actor.temperature", "actor.temperature"),
]


def _get(obj, dotted):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_every_yaml_loads_in_areal_with_the_kits_values(path, profile, tmp_path):
    from areal.api.cli_args import GRPOConfig
    from areal.api.cli_args import load_expr_config as areal_load

    areal, kit_only = to_areal_config(path, profile=profile)
    out = tmp_path / "areal.yaml"
    out.write_text(yaml.safe_dump(areal))
    theirs, _ = areal_load(["--config", str(out), f"cluster.fileroot={tmp_path}"], GRPOConfig)
    ours, _ = load_expr_config(["--config", path, f"profile={profile}"], TrainConfig, verbose=False)
    for kit_key, areal_key in SHARED:
        assert _get(ours, kit_key) == _get(theirs, areal_key), (kit_key, _get(ours, kit_key), _get(theirs, areal_key))
    assert theirs.rollout.backend.startswith(("sglang:", "vllm:")) and theirs.actor.backend == "fsdp:d1"
    # kit-only keys are listed, not dropped: the profile switch, the server choice, the CPU thread count
    assert {"profile", "backend", "actor.threads", "train_dataset.type"} <= set(kit_only)


def test_cli_writes_an_areal_yaml(tmp_path, capsys):
    """`python -m areal_lite.kit.areal.config configs/gsm8k_grpo.yaml -o OUT`, called in this process: a new one would
    spend ~10 s importing AReaL again for the same code."""
    from areal_lite.kit.areal.config import main

    out = tmp_path / "gsm8k_areal.yaml"
    assert main([os.path.join(ROOT, "configs", "gsm8k_grpo.yaml"), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "kit-only keys left out:" in printed and "profile" in printed
    written = yaml.safe_load(out.read_text())
    assert written["actor"]["path"] == "Qwen/Qwen2.5-1.5B-Instruct"
    assert written["train_dataset"]["path"] == "openai/gsm8k"


def test_exported_experiment_imports_under_areal_and_its_config_loads(tmp_path):
    """What notebook 08 does with notebook 05's cells, on a small workflow cell: the script imports under AReaL (its
    workflow is an AReaL RolloutWorkflow, its imports rewritten) and AReaL loads the YAML written beside it."""
    from areal_lite.kit.areal.compat import export_areal_experiment

    imports = (
        "import torch\n\n"
        "from areal_lite.api.io_struct import ModelRequest\n"
        "from areal_lite.api.workflow_api import RolloutWorkflow\n"
        "from areal_lite.utils.data import concat_padded_tensors\n"
    )
    agent = (
        "class EchoAgent(RolloutWorkflow):\n"
        "    def __init__(self, tokenizer, gconfig, greeting):\n"
        "        self.tokenizer, self.gconfig, self.greeting = tokenizer, gconfig, greeting\n\n"
        "    async def arun_episode(self, engine, data):\n"
        "        return await engine.agenerate(ModelRequest(input_ids=[1], gconfig=self.gconfig))\n"
    )
    config, _ = to_areal_config(os.path.join(ROOT, "configs", "gsm8k_grpo.yaml"), profile="gpu")
    paths = export_areal_experiment(
        str(tmp_path),
        "echo_areal",
        [imports, agent],
        workflow="EchoAgent",
        workflow_kwargs="dict(tokenizer=tokenizer, gconfig=config.gconfig, greeting=HI)",
        config=config,
        rows=[{"question": "q", "answer": "a"}],
        constants={"HI": "hello"},
    )
    script = open(paths["script"]).read()
    assert "from areal.api.io_struct import ModelRequest" in script
    assert "from areal.api.workflow_api import RolloutWorkflow" in script
    assert "from areal.utils.data import concat_padded_tensors" in script and "from areal_lite" not in script
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]); import echo_areal as m\n"
        "from areal.api import RolloutWorkflow\n"
        "from areal.api.cli_args import GRPOConfig, load_expr_config\n"
        "cfg, _ = load_expr_config(['--config', sys.argv[2], 'cluster.fileroot=' + sys.argv[1]], GRPOConfig)\n"
        "assert issubclass(m.EchoAgent, RolloutWorkflow) and m.HI == 'hello'\n"
        "print(cfg.actor.path, len(open(sys.argv[3]).readlines()))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe, str(tmp_path), paths["config"], paths["data"]],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].split() == ["Qwen/Qwen2.5-1.5B-Instruct", "1"]  # AReaL logs above


def _default(field):
    import dataclasses

    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def _shared_scalar_defaults(kit_cls, areal_cls, prefix, out):
    import dataclasses

    theirs = {f.name: f for f in dataclasses.fields(areal_cls)}
    for f in dataclasses.fields(kit_cls):
        if f.name not in theirs or f.name in ("experiment_name", "trial_name"):
            continue
        a, b = _default(f), _default(theirs[f.name])
        if dataclasses.is_dataclass(a) or dataclasses.is_dataclass(b) or b is dataclasses.MISSING:
            continue
        if b == "???" or isinstance(b, tuple):  # AReaL's required fields; scheduler specs (test_areal_fields.py)
            continue
        out[prefix + f.name] = (a, b)
    return out


def test_the_table_of_defaults_that_differ_from_areal_is_true_and_complete():
    """Every shared default the kit sets differently from AReaL 1.0.4 is in AREAL_DEFAULT_DIFFERENCES with AReaL's
    real value, and nothing else is: no kit default differs silently."""
    from areal.api import cli_args as areal

    from areal_lite.api import cli_args as kit
    from areal_lite.api.cli_args import AREAL_DEFAULT_DIFFERENCES

    pairs = {}
    for kit_cls, areal_cls, prefix in [
        (kit.PPOActorConfig, areal.PPOActorConfig, "actor."),
        (kit.OptimizerConfig, areal.OptimizerConfig, "actor.optimizer."),
        (kit.InferenceEngineConfig, areal.InferenceEngineConfig, "rollout."),
        (kit.GenerationHyperparameters, areal.GenerationHyperparameters, "gconfig."),
        (kit.NormConfig, areal.NormConfig, "actor.reward_norm."),
    ]:
        _shared_scalar_defaults(kit_cls, areal_cls, prefix, pairs)
    differing = {key: theirs for key, (ours, theirs) in pairs.items() if ours != theirs}
    assert differing == {key: areal_value for key, (areal_value, _) in AREAL_DEFAULT_DIFFERENCES.items()}
