"""Strict config loading: every bad input names the file, the dotted key, the expected type and a near key."""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass, field

import pytest

from areal_lite.api.cli_args import (
    ConfigError,
    GenerationHyperparameters,
    GRPOConfig,
    SGLangConfig,
    describe,
    load_expr_config,
)
from areal_lite.infra.remote_inf_engine import sampling_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")


@dataclass
class AgentRLConfig(GRPOConfig):
    max_turns: int = field(default=128, metadata={"help": "maximum number of turns per trajectory"})


def write(tmp_path, text: str) -> str:
    path = tmp_path / "exp.yaml"
    path.write_text(text)
    return str(path)


# (yaml text, overrides, fragments the message must contain)
BAD_CASES = [
    ("actor:\n  optimzer:\n    lr: 1e-5\n", [], ["exp.yaml", "actor.optimzer", "did you mean 'actor.optimizer'"]),
    ("gconfig:\n  max_new_token: 5\n", [], ["gconfig.max_new_token", "did you mean 'gconfig.max_new_tokens'"]),
    ("gconfig:\n  max_new_tokens: 16.0\n", [], ["gconfig.max_new_tokens", "expected int", "float 16.0"]),
    ("gconfig:\n  max_new_tokens: many\n", [], ["gconfig.max_new_tokens", "expected int", "str 'many'"]),
    ("gconfig:\n  greedy: 1\n", [], ["gconfig.greedy", "expected bool"]),
    ("gconfig:\n  stop: '</answer>'\n", [], ["gconfig.stop", "expected list[str] | null"]),
    ("gconfig:\n  stop: [1, 2]\n", [], ["gconfig.stop[0]", "expected str"]),
    ("gconfig:\n  stop_token_ids: [1, x]\n", [], ["gconfig.stop_token_ids[1]", "expected int"]),
    ("actor:\n  optimizer:\n    lr: fast\n", [], ["actor.optimizer.lr", "expected float"]),
    ("actor:\n  optimizer: 0.1\n", [], ["actor.optimizer", "expected a mapping (OptimizerConfig)"]),
    ("actor:\n  dtype: fp32\n", [], ["actor.dtype", "expected one of", "float32"]),
    ("backend: sglng\n", [], ["backend", "did you mean 'sglang'"]),
    ("profile: gpus\n", [], ["profile", "did you mean 'gpu'"]),
    ("rollout:\n  max_head_offpolicynes: 2\n", [], ["rollout.max_head_offpolicynes", "max_head_offpolicyness"]),
    ("trainset:\n  batch_size: 2\n", [], ["trainset", "unknown key for GRPOConfig"]),
    ("train_dataset:\n  batch_size: null\n", [], ["train_dataset.batch_size", "got null"]),
    (
        "actor:\n  reward_norm:\n    mean_lvl: group\n",
        [],
        ["actor.reward_norm.mean_lvl", "actor.reward_norm.mean_level"],
    ),
    ("- a\n- b\n", [], ["exp.yaml", "top level must be a mapping"]),
    ("actor: [1, 2\n", [], ["exp.yaml", "not valid YAML"]),
    ("profiles:\n  cpux:\n    backend: embedded\n", [], ["profiles.cpux", "did you mean 'profiles.cpu'"]),
    ("profiles:\n  cpu:\n    actor:\n      pth: x\n", [], ["profile cpu", "actor.pth", "actor.path"]),
    ("profiles: 3\n", [], ["profiles", "expected a mapping"]),
    ("", ["actor.optimizer.lr=abc"], ["command line", "actor.optimizer.lr", "expected float"]),
    ("", ["gconfig.n_sample=4"], ["command line", "gconfig.n_sample", "gconfig.n_samples"]),
    ("", ["actor.optimizer.lr"], ["command line", "key=value"]),
    ("", ["--cfg", "x.yaml"], ["unknown option '--cfg'"]),
    ("", ["=3"], ["empty key"]),
    ("", ["gconfig.stop=[a, b"], ["cannot parse value"]),
    ("", ["max_turns=3"], ["max_turns", "unknown key for GRPOConfig"]),
    ("actor:\n  device: mps\n", [], ["exp.yaml", "key 'actor.device'", "MPS lacks the float64", "got 'mps'"]),
    ("", ["embedded.device=gpu"], ["command line", "embedded.device", "expected auto, cpu, cuda or cuda:N"]),
]


@pytest.mark.parametrize("text,overrides,fragments", BAD_CASES)
def test_bad_config_messages(tmp_path, text, overrides, fragments):
    path = write(tmp_path, text)
    argv = ["--config", path] + overrides
    with pytest.raises(ConfigError) as err:
        load_expr_config(argv, GRPOConfig, verbose=False)
    message = str(err.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_bad_case_count():
    assert len(BAD_CASES) >= 20


def test_missing_file_names_path():
    with pytest.raises(ConfigError, match=r"/no/such/file.yaml: config file not found"):
        load_expr_config(["--config", "/no/such/file.yaml"], GRPOConfig, verbose=False)
    with pytest.raises(ConfigError, match="--config needs a file path"):
        load_expr_config(["--config"], GRPOConfig, verbose=False)


def test_overrides_and_types(tmp_path):
    path = write(tmp_path, "actor:\n  optimizer:\n    lr: 1e-5\n  path: some/model\ngconfig:\n  n_samples: 4\n")
    config, got_path = load_expr_config(
        ["--config", path, "actor.optimizer.lr=2e-5", "gconfig.stop=['</answer>']", "trial_name=7"],
        GRPOConfig,
        verbose=False,
    )
    assert got_path == path
    assert config.actor.optimizer.lr == pytest.approx(2e-5)
    assert isinstance(config.actor.optimizer.lr, float)
    assert config.gconfig.stop == ["</answer>"]
    assert config.trial_name == "7"
    # derived once, from the one place they are given
    assert config.actor.group_size == 4
    assert config.tokenizer_path == "some/model"
    assert config.embedded.model_path == "some/model"


def test_profiles_cpu_gpu_and_print(tmp_path, capsys):
    path = write(
        tmp_path,
        "backend: sglang\nactor:\n  path: big\n"
        "profiles:\n  cpu:\n    backend: embedded\n    actor:\n      path: small\n",
    )
    cpu, _ = load_expr_config(["--config", path, "profile=cpu"], GRPOConfig)
    assert (cpu.backend, cpu.actor.path, cpu.profile) == ("embedded", "small", "cpu")
    assert "profile=cpu" in capsys.readouterr().out
    gpu, _ = load_expr_config(["--config", path, "profile=gpu"], GRPOConfig)
    assert (gpu.backend, gpu.actor.path, gpu.profile) == ("sglang", "big", "gpu")
    # the command line beats the profile
    cli, _ = load_expr_config(["--config", path, "profile=cpu", "actor.path=mine"], GRPOConfig, verbose=False)
    assert cli.actor.path == "mine"
    auto, _ = load_expr_config(["--config", path], GRPOConfig)
    import torch

    assert auto.profile == ("gpu" if torch.cuda.is_available() else "cpu")
    assert "auto:" in capsys.readouterr().out


def test_kit_defaults_that_differ_from_areal_are_listed_only_when_asked(tmp_path, capsys):
    path = write(tmp_path, "actor:\n  kl_ctl: 0.1\n")
    load_expr_config(["--config", path, "profile=cpu"], GRPOConfig)
    assert "AReaL" not in capsys.readouterr().out  # every notebook loads a config: the list is not repeated there
    load_expr_config(["--config", path, "profile=cpu"], GRPOConfig, verbose=False, explain_defaults=True)
    lines = capsys.readouterr().out.splitlines()
    assert "  actor.ppo_n_minibatches = 1 (AReaL: 4): small CPU batches: one optimizer step per batch" in lines
    assert not any("kl_ctl" in line for line in lines), "a key the config sets is not a default left in place"


def test_subclass_adds_fields_and_twice_in_one_process():
    argv = ["--config", os.path.join(CONFIGS, "search_agent.yaml"), "profile=cpu"]
    first, _ = load_expr_config(argv, AgentRLConfig, verbose=False)
    second, _ = load_expr_config(argv + ["max_turns=5"], AgentRLConfig, verbose=False)
    assert first.max_turns == 3 and second.max_turns == 5
    assert isinstance(first, AgentRLConfig)
    assert first.gconfig.stop == ["</search>", "</answer>"]


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(CONFIGS, "*.yaml"))))
@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_shipped_configs_load(path, profile):
    config, _ = load_expr_config(["--config", path, f"profile={profile}"], AgentRLConfig, verbose=False)
    if profile == "cpu":
        assert config.backend == "embedded"
        assert "smollm2" in config.actor.path.lower()
    elif "search_agent" in path or "gsm8k" in path:
        assert config.actor.path.startswith("Qwen/Qwen2.5-1.5B")


def test_generation_hyperparameters_new_and_sampling_params():
    g = GenerationHyperparameters(n_samples=4, max_new_tokens=32, stop=["</answer>"])
    one = g.new(n_samples=1)
    assert one.n_samples == 1 and g.n_samples == 4 and one.stop == ["</answer>"]
    with pytest.raises(TypeError, match="n_sample"):
        g.new(n_sample=1)
    params = sampling_params(g.new(greedy=True))
    assert params["temperature"] == 0.0 and params["n"] == 1 and params["stop"] == ["</answer>"]
    assert isinstance(params["max_new_tokens"], int)


def test_build_cmd_is_argv():
    cmd = SGLangConfig.build_cmd(SGLangConfig(model_path="m", disable_cuda_graph=True), port=1234, base_gpu_id=1)
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    assert cmd[cmd.index("--port") + 1] == "1234"
    assert "--disable-cuda-graph" in cmd and "--skip-tokenizer-init" not in cmd
    with pytest.raises(ConfigError, match="model_path"):
        SGLangConfig.build_cmd(SGLangConfig())


def test_every_field_has_help():
    text = describe(GRPOConfig)
    for line in text.splitlines():
        assert not line.rstrip().endswith(":"), f"field without help: {line}"
    assert "actor.optimizer.lr (float" in text


def test_environment_switch(tmp_path, monkeypatch):
    path = write(tmp_path, "backend: sglang\nprofiles:\n  cpu:\n    backend: embedded\n")
    monkeypatch.setenv("AREAL_LITE_PROFILE", "gpu")
    config, _ = load_expr_config(["--config", path], GRPOConfig, verbose=False)
    assert (config.profile, config.backend) == ("gpu", "sglang")
    monkeypatch.setenv("AREAL_LITE_OVERRIDES", "backend=embedded embedded.device=cuda")
    config, _ = load_expr_config(["--config", path], GRPOConfig, verbose=False)
    assert (config.profile, config.backend, config.embedded.device) == ("gpu", "embedded", "cuda")
    # an explicit profile in argv still wins over the environment
    config, _ = load_expr_config(["--config", path, "profile=cpu"], GRPOConfig, verbose=False)
    assert config.profile == "cpu"
    monkeypatch.setenv("AREAL_LITE_PROFILE", "gpux")
    with pytest.raises(ConfigError, match="AREAL_LITE_PROFILE.*did you mean 'gpu'"):
        load_expr_config(["--config", path], GRPOConfig, verbose=False)


def test_actor_temperature_follows_sampling_temperature(tmp_path):
    path = write(tmp_path, "gconfig:\n  temperature: 0.8\n")
    config, _ = load_expr_config(["--config", path], GRPOConfig, verbose=False)
    assert config.actor.temperature == 0.8
    with pytest.raises(ConfigError, match="actor.temperature=0.5 differs from gconfig.temperature=0.8"):
        load_expr_config(["--config", path, "actor.temperature=0.5"], GRPOConfig, verbose=False)
    greedy, _ = load_expr_config(["--config", path, "gconfig.greedy=true"], GRPOConfig, verbose=False)
    assert greedy.actor.temperature == 1.0


def test_weight_update_dir_defaults_to_ram_when_available(tmp_path):
    config, _ = load_expr_config(["experiment_name=e", "trial_name=t"], GRPOConfig, verbose=False)
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        assert config.weight_update_dir.startswith("/dev/shm/")
    # Per run, claimed while this process lives (`utils.weight_dirs`): a second live process with the same names
    # (the en and zh notebooks side by side) gets `weights.1`; loading the config again here gets the same folder.
    assert re.search(r"/e/t/weights(\.\d+)?$", config.weight_update_dir), config.weight_update_dir
    again, _ = load_expr_config(["experiment_name=e", "trial_name=t"], GRPOConfig, verbose=False)
    assert again.weight_update_dir == config.weight_update_dir
    explicit, _ = load_expr_config([f"weight_update_dir={tmp_path}"], GRPOConfig, verbose=False)
    assert explicit.weight_update_dir == str(tmp_path)


def test_weight_versions_go_to_disk_where_dev_shm_cannot_hold_one(tmp_path, monkeypatch, capsys):
    """A container's /dev/shm is often 64 MB (Docker's default), less than one SmolLM2 version (~0.5 GB): the default
    folder is then under fileroot, and a line says why, rather than a run that cannot write its first version."""
    import collections
    import shutil

    demo = os.path.join(ROOT, "configs", "arith_grpo_demo.yaml")
    real = shutil.disk_usage
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(64 << 20, 0, 64 << 20) if p == "/dev/shm" else real(p))
    args = ["--config", demo, f"fileroot={tmp_path}", "trial_name=small-shm"]
    config, _ = load_expr_config(args, GRPOConfig, verbose=False)
    assert config.weight_update_dir == str(tmp_path / "arith-grpo-demo" / "small-shm" / "weights")
    assert re.search(r"/dev/shm holds 64 MiB, less than one weight version \(5\d\d MiB\)", capsys.readouterr().out)
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):  # a /dev/shm that holds a version: RAM
        monkeypatch.setattr(shutil, "disk_usage", real)
        config, _ = load_expr_config([*args, "trial_name=big-shm"], GRPOConfig, verbose=False)
        assert config.weight_update_dir.startswith("/dev/shm/")


def test_every_embedded_server_option_is_settable_from_a_config(tmp_path):
    """The options the embedded server takes are EmbeddedServerConfig's fields, so YAML and overrides reach them and
    `cli_args()` carries them to the server's command line."""
    path = write(tmp_path, "embedded:\n  max_prefill_tokens: 512\n  return_original_logprob: true\n")
    config, _ = load_expr_config(["--config", path, "embedded.decode_log_interval=0"], GRPOConfig, verbose=False)
    emb = config.embedded
    assert (emb.max_prefill_tokens, emb.return_original_logprob, emb.decode_log_interval) == (512, True, 0)
    args = emb.cli_args()
    assert args[args.index("--max-prefill-tokens") + 1] == "512" and "--return-original-logprob" in args
    assert args[args.index("--decode-log-interval") + 1] == "0"
    assert "--context-length" not in args  # None: the server's default (the model's length) applies


@pytest.mark.parametrize(
    "override, key",
    [
        ("gconfig.n_samples=-3", "gconfig.n_samples"),
        ("gconfig.max_new_tokens=0", "gconfig.max_new_tokens"),
        ("gconfig.temperature=nan", "gconfig.temperature"),
        ("actor.optimizer.lr=-1e-5", "actor.optimizer.lr"),
        ("actor.path=", "actor.path"),
        ("trial_name=", "trial_name"),
        ("actor.optimizer=null", "actor.optimizer"),  # AReaL's "does not train"; the actor trains
        ("gconfig.top_p=1.5", "gconfig.top_p"),  # else the server refuses it at the first rollout
        ("train_dataset.batch_size=0", "train_dataset.batch_size"),
        ("rollout.consumer_batch_size=0", "rollout.consumer_batch_size"),
        ("rollout.max_concurrent_rollouts=0", "rollout.max_concurrent_rollouts"),
        ("rollout.max_head_offpolicyness=-1", "rollout.max_head_offpolicyness"),
        ("actor.ppo_n_minibatches=0", "actor.ppo_n_minibatches"),
        ("actor.eps_clip=-1", "actor.eps_clip"),
        ("total_train_epochs=0", "total_train_epochs"),
        ("total_train_steps=-1", "total_train_steps"),
    ],
)
def test_values_no_run_can_use_are_refused_at_load(override, key):
    """Values the types allow but no run can use fail at load, naming the key, not later in a traceback."""
    path = os.path.join(CONFIGS, "arith_grpo_demo.yaml")
    with pytest.raises(ConfigError, match=rf"key '{re.escape(key)}': expected "):
        load_expr_config(["--config", path, override], GRPOConfig, verbose=False)


@pytest.mark.parametrize(
    "text, overrides, start",
    [
        ("", ["actor.rejection_sampling.upper=0.5"], "command line: section 'actor.rejection_sampling' "
         "(actor.rejection_sampling.upper=0.5): upper must be > 1.0"),
        ("actor:\n  rejection_sampling:\n    lower: 9.0\n", ["actor.rejection_sampling.upper=2.0"],
         "exp.yaml and command line: section 'actor.rejection_sampling' (actor.rejection_sampling.lower=9.0, "
         "actor.rejection_sampling.upper=2.0): lower (9.0) cannot be greater than upper (2.0)"),
    ],
)  # fmt: skip
def test_a_sections_own_check_names_its_keys_and_where_they_were_set(tmp_path, text, overrides, start):
    """A section's own check (its __post_init__) names no key, and the value may come from the command line: the
    message must say which keys of which section, set where (it blamed the YAML file for a command-line value)."""
    with pytest.raises(ConfigError) as err:
        load_expr_config(["--config", write(tmp_path, text), *overrides], GRPOConfig, verbose=False)
    message = str(err.value)
    assert start in message and (message.startswith(str(tmp_path)) or message.startswith("command line")), message


def test_environment_overrides_say_where_they_come_from_and_keep_quoted_values(monkeypatch):
    path = os.path.join(CONFIGS, "arith_grpo_demo.yaml")
    monkeypatch.setenv("AREAL_LITE_OVERRIDES", "seed=3 experiment_name='my exp'")
    config, _ = load_expr_config(["--config", path], GRPOConfig, verbose=False)
    assert (config.seed, config.experiment_name) == (3, "my exp")
    monkeypatch.setenv("AREAL_LITE_OVERRIDES", "gconfig.n_samples")
    with pytest.raises(ConfigError, match="^AREAL_LITE_OVERRIDES: 'gconfig.n_samples' is not an override"):
        load_expr_config(["--config", path], GRPOConfig, verbose=False)


def test_the_command_lines_print_a_config_error_in_one_line(capsys, tmp_path):
    """The trainer's and the AReaL export's command lines: a config mistake is one line on stderr and exit 2."""
    from areal_lite.kit.areal.config import main as export_main
    from areal_lite.kit.trainer.train import main as train_main

    path = os.path.join(CONFIGS, "arith_grpo_demo.yaml")
    assert train_main(["--config", path, "actor.optimizer.lrr=1e-5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("train: command line: key 'actor.optimizer.lrr'") and len(err.splitlines()) == 1
    assert train_main(["--config", path, "--resum"]) == 2
    err = capsys.readouterr().err
    assert err == "train: command line: unknown option '--resum'; did you mean '--resume'? (see --help)\n"
    bad = tmp_path / "bad.yaml"
    bad.write_text("experiment_name: e\ngconfig:\n  n_samples: 0\n")
    assert train_main(["--config", str(bad)]) == 2  # a value no run can use, set in a file: the file is named
    err = capsys.readouterr().err
    assert err == f"train: {bad}: key 'gconfig.n_samples': expected an integer >= 1, got 0\n"
    assert export_main([str(tmp_path / "nope.yaml"), "-o", str(tmp_path / "o.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("areal config: ") and "config file not found" in err and len(err.splitlines()) == 1
    assert train_main(["total_train_steps=1"]) == 2  # no file: nothing to train, said before anything starts
    assert capsys.readouterr().err == "train: --config FILE is needed (e.g. configs/arith_grpo_demo.yaml); see --help\n"


def test_the_demo_command_line_helps_and_refuses_in_one_line(capsys):
    """`python -m areal_lite.kit.trainer.demo --help` prints its usage (it trained, then failed on '--help'); a
    mistyped override is one line on stderr and exit 2, before any server starts."""
    from areal_lite.kit.trainer.demo import main as demo_main

    assert demo_main(["--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: python -m areal_lite.kit.trainer.demo [key=value ...]")
    assert demo_main(["total_train_step=4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("demo: command line: key 'total_train_step'") and len(err.splitlines()) == 1, err


@pytest.mark.parametrize(
    "override, hint",
    [
        ("actor.optimizer.lrr=1e-5", "did you mean 'actor.optimizer.lr'?"),  # a typo: the close spelling
        ("actor.lr=1e-5", "did you mean 'actor.optimizer.lr'?"),  # a level off: the same name in its section
        ("actor.lrr=1e-5", "did you mean 'actor.optimizer.lr'?"),  # both: a close spelling in its section
        ("n_samples=2", "did you mean 'gconfig.n_samples' or 'eval_gconfig.n_samples'?"),  # its section left out
    ],
)
def test_an_unknown_key_is_pointed_to_where_it_belongs(override, hint):
    path = os.path.join(CONFIGS, "arith_grpo_demo.yaml")
    with pytest.raises(ConfigError, match=re.escape(hint)):
        load_expr_config(["--config", path, override], GRPOConfig, verbose=False)


def test_a_yaml_key_indented_one_level_off_is_pointed_to_its_place(tmp_path):
    path = write(tmp_path, "actor:\n  optimizer:\n    type: adam\n  lr: 1.0e-5\n")
    with pytest.raises(ConfigError, match=re.escape("key 'actor.lr': unknown key for PPOActorConfig; did you mean "
                                                    "'actor.optimizer.lr'?")):  # fmt: skip
        load_expr_config(["--config", path], GRPOConfig, verbose=False)


def test_a_misspelt_environment_variable_is_refused_by_name(monkeypatch):
    """`AREAL_LITE_OVERIDES=...` would be ignored without a word (the run goes on without the overrides): loading a
    config refuses any AREAL_LITE_* name the kit does not read, and names the nearest one it does."""
    monkeypatch.setenv("AREAL_LITE_OVERIDES", "backend=vllm")
    with pytest.raises(
        ConfigError, match="AREAL_LITE_OVERIDES: not one the kit reads; did you mean AREAL_LITE_OVERRIDES"
    ):
        load_expr_config([], GRPOConfig, verbose=False)
    monkeypatch.delenv("AREAL_LITE_OVERIDES")
    load_expr_config([], GRPOConfig, verbose=False)


def test_the_kit_reads_exactly_the_environment_variables_it_lists():
    """config_loader.ENVIRONMENT against every AREAL_LITE_* name in the code, tools, benches, tests and docs."""
    from areal_lite.api.config_loader import ENVIRONMENT

    paths = [os.path.join(ROOT, name) for name in ("Makefile", "README.md")]
    for folder in ("areal_lite", "tools", "bench", "tests", "notebooks/src", "docs", ".ci"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            exts = (".py", ".md", ".sh", ".cfg", ".yaml", "run")
            paths += [os.path.join(dirpath, name) for name in files if name.endswith(exts)]
    used = set()
    for path in paths:
        with open(path, encoding="utf-8") as f:
            used |= set(re.findall(r"AREAL_LITE_[A-Z][A-Z0-9_]*[A-Z0-9]", f.read()))
    used.discard("AREAL_LITE_OVERIDES")  # the misspelling the test above sets
    assert used == set(ENVIRONMENT)
