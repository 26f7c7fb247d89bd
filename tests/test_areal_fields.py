"""AReaL 1.0.4's configs load in the kit: every field of every config class exists in the kit's with AReaL's default
(modulo the two documented tables), every kit-only field is known, AReaL's own GSM8K GRPO YAML loads, an AReaL cell
that builds its configs runs word for word, and an AReaL field the kit ignores is reported once.
"""

from __future__ import annotations

import dataclasses
import os
import typing

import pytest

from areal_lite.api import areal_only
from areal_lite.api import cli_args as kit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AREAL_YAML = os.path.join(ROOT, "tests", "data", "areal_1.0.4_gsm8k_grpo.yaml")
# Kit-only fields (AReaL 1.0.4 lacks them), dotted from the experiment config; each is marked "(kit-only)" or is
# one of these known extras of the kit.
KIT_ONLY = {
    "fileroot", "profile", "backend", "embedded", "async_training", "weight_update_dir",
    "train_dataset.size", "train_dataset.seed", "valid_dataset.size", "valid_dataset.seed", "saver.keep_last",
    "evaluator.size", "stats_logger.wandb_mode", "sglang.trust_remote_code", "vllm.python", "vllm.threads",
    "vllm.cpu_kv_cache_gb", "vllm.logprobs_mode", "rollout.pause_poll_interval", "actor.device", "actor.threads",
    "actor.seed", "actor.group_size", "actor.behav_imp_weight_cap", "critic.device", "critic.threads", "critic.seed",
}  # fmt: skip


def _default(f):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING


def _sub(tp):
    return next((t for t in (tp, *typing.get_args(tp)) if dataclasses.is_dataclass(t)), None)


def _walk(kit_cls, areal_cls, prefix, out):
    """(missing, differing defaults, kit-only) of kit_cls against areal_cls, recursively, as dotted keys. Each pair
    of classes is walked once, at its first path (`actor.`, not `ref.` or `teacher.train.`)."""
    if (kit_cls, areal_cls) in out.setdefault("seen", set()):
        return out
    out["seen"].add((kit_cls, areal_cls))
    ours, theirs = {f.name: f for f in dataclasses.fields(kit_cls)}, {f.name: f for f in dataclasses.fields(areal_cls)}
    kh, ah = typing.get_type_hints(kit_cls), typing.get_type_hints(areal_cls)
    for name, f in theirs.items():
        key = prefix + name
        if name not in ours:
            out["missing"].append(key)
            continue
        k_sub, a_sub = _sub(kh[name]), _sub(ah[name])
        assert (k_sub is None) == (a_sub is None), (key, kh[name], ah[name])
        if k_sub is not None:
            _walk(k_sub, a_sub, key + ".", out)
        a, k = _default(f), _default(ours[name])
        if a == "???" or (dataclasses.is_dataclass(a) and dataclasses.is_dataclass(k)):
            continue  # AReaL requires it (the kit gives a default), or compared field by field above
        if isinstance(a, tuple):
            a, k = [dataclasses.asdict(x) for x in a], [dataclasses.asdict(x) for x in k]
        if a != k:  # the critic's engine defaults are the actor's (one TrainEngineConfig)
            out["differ"][key.replace("critic.", "actor.", 1)] = a
    out["kit_only"] += [prefix + n for n in ours if n not in theirs]
    return out


def test_every_areal_field_is_in_the_kit_with_areals_default_and_every_kit_only_field_is_known():
    from areal.api import cli_args as areal

    out = _walk(kit.GRPOConfig, areal.GRPOConfig, "", {"missing": [], "differ": {}, "kit_only": []})
    assert out["missing"] == []
    documented = {**kit.AREAL_DEFAULT_DIFFERENCES, **kit.AREAL_SETUP_DIFFERENCES}
    assert out["differ"] == {key: areal_value for key, (areal_value, _) in documented.items()}
    assert set(out["kit_only"]) == KIT_ONLY


@pytest.mark.parametrize(
    "name",
    ["BaseExperimentConfig", "PPOConfig", "GRPOConfig", "TrainEngineConfig", "PPOCriticConfig", "TeacherConfig",
     "TrainDatasetConfig", "ValidDatasetConfig", "SchedulingSpec", "AgentConfig", "MegatronEngineConfig",
     "WandBConfig", "ClusterSpecConfig"],
)  # fmt: skip
def test_areal_config_classes_import_from_the_kit_with_every_field(name):
    from areal.api import cli_args as areal

    ours, theirs = getattr(kit, name), getattr(areal, name)
    assert {f.name for f in dataclasses.fields(theirs)} <= {f.name for f in dataclasses.fields(ours)}


def test_every_field_has_help_and_the_tables_name_real_fields():
    for name in kit.__all__:
        cls = getattr(kit, name)
        if isinstance(cls, type) and dataclasses.is_dataclass(cls):
            assert all(f.metadata.get("help") for f in dataclasses.fields(cls)), name
    fields = {
        f"{cls.__name__}.{f.name}"
        for cls in map(lambda n: getattr(kit, n), kit.__all__)
        if isinstance(cls, type) and dataclasses.is_dataclass(cls)
        for f in dataclasses.fields(cls)
    }
    assert set(areal_only.AREAL_ONLY_FIELDS) <= fields
    honoured = {k for k in areal_only.AREAL_HONOURED if not k.endswith(".*")}
    assert honoured <= fields and not honoured & set(areal_only.AREAL_ONLY_FIELDS)


def test_arealss_own_gsm8k_grpo_yaml_loads_in_the_kit(capsys):
    areal_only._reported.clear()
    config, _ = kit.load_expr_config(["--config", AREAL_YAML, "profile=gpu"], verbose=False)
    assert config.rollout.backend == "sglang:d4p1t1" and config.backend == "sglang"
    assert config.rollout.consumer_batch_size == 256 and config.actor.temperature == 1.0
    assert config.actor.behav_imp_weight_cap == 5.0  # rejection_sampling: ratio, token, mask, upper 5
    assert config.actor.scheduling_spec[0].gpu == 1 and config.rollout.scheduling_spec == config.actor.scheduling_spec
    assert config.ref.scheduling_strategy.type == "colocation" and config.ref.optimizer is None
    assert config.valid_dataset.split == "test" and config.train_dataset.type == "rl"
    assert config.tokenizer_path == config.rollout.tokenizer_path == "Qwen/Qwen2.5-1.5B-Instruct"
    printed = capsys.readouterr().out
    assert "`BaseExperimentConfig.cluster` has no effect in the kit" in printed
    assert "`rollout.backend` parallel degrees other than 1 (d4p1t1) have no effect" in printed


def test_a_kit_profile_that_contradicts_rollout_backend_is_an_error():
    with pytest.raises(kit.ConfigError, match="rollout.backend='sglang:d4p1t1' asks for sglang but backend='embedded'"):
        kit.load_expr_config(["--config", AREAL_YAML, "backend=embedded"], verbose=False)
    config, _ = kit.load_expr_config(["--config", AREAL_YAML, "rollout.backend=embedded:d1"], verbose=False)
    assert config.backend == "embedded"
    with pytest.raises(kit.ConfigError, match="prefix must be one of"):
        kit.InferenceEngineConfig(backend="tensorrt:d1")


def test_an_areal_cell_that_builds_its_configs_runs_word_for_word():
    """The configuration lines of an AReaL 1.0.4 script, with only the import prefix changed."""
    from areal_lite.api.cli_args import (
        GenerationHyperparameters,
        GRPOConfig,
        InferenceEngineConfig,
        MicroBatchSpec,
        NormConfig,
        OptimizerConfig,
        PPOActorConfig,
        SchedulingSpec,
    )

    rollout = InferenceEngineConfig(
        backend="sglang:d1", experiment_name="gsm8k-grpo", trial_name="trial0", max_concurrent_rollouts=16,
        consumer_batch_size=8, max_head_offpolicyness=2, scheduling_spec=(SchedulingSpec(gpu=1, mem=32),),
        check_trajectory_format=True, dump_to_file=False, tokenizer_path="Qwen/Qwen2.5-1.5B-Instruct",
    )  # fmt: skip
    actor = PPOActorConfig(
        backend="fsdp:d1", experiment_name="gsm8k-grpo", trial_name="trial0", path="Qwen/Qwen2.5-1.5B-Instruct",
        attn_impl="sdpa", dtype="bfloat16", mb_spec=MicroBatchSpec(max_tokens_per_mb=10240),
        optimizer=OptimizerConfig(lr=1.7e-5, weight_decay=0.017), eps_clip=0.4, reward_scaling=10.0,
        reward_bias=-0.5, kl_ctl=0.0, ppo_n_minibatches=1, recompute_logprob=True, use_decoupled_loss=True,
        reward_norm=NormConfig(mean_level="group", std_level="group"), adv_norm=NormConfig(),
        weight_update_mode="xccl",
    )  # fmt: skip
    config = GRPOConfig(
        experiment_name="gsm8k-grpo", trial_name="trial0", rollout=rollout, actor=actor,
        gconfig=GenerationHyperparameters(n_samples=4, max_new_tokens=1024),
    )  # fmt: skip
    assert kit.server_backend(config) == "sglang"
    assert config.actor.optimizer.lr == 1.7e-5 and config.rollout.consumer_batch_size == 8


def test_an_ignored_field_is_reported_once_and_defaults_never(capsys):
    areal_only._reported.clear()
    kit.InferenceEngineConfig()
    kit.GRPOConfig()
    assert capsys.readouterr().out == ""
    for _ in range(3):
        kit.InferenceEngineConfig(scheduling_spec=(kit.SchedulingSpec(gpu=4),))
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "areal-lite: `InferenceEngineConfig.scheduling_spec` has no effect in the kit: "
        + areal_only.AREAL_ONLY_FIELDS["InferenceEngineConfig.scheduling_spec"][1]
    ]


def test_a_refused_field_is_an_error_that_says_why():
    with pytest.raises(kit.ConfigError, match="`TrainEngineConfig.init_from_scratch` = True is not supported by"):
        kit.PPOActorConfig(init_from_scratch=True)
    with pytest.raises(kit.ConfigError, match="discount"):
        kit.PPOActorConfig(discount=0.99)
    with pytest.raises(kit.ConfigError, match="only level=token, action=mask, metric=ratio"):
        kit.PPOActorConfig(rejection_sampling=kit.RejectionSamplingConfig(level="sequence"))


@pytest.mark.parametrize("name", sorted(n for n in os.listdir(os.path.join(ROOT, "configs")) if n.endswith(".yaml")))
def test_the_shipped_configs_load_without_a_no_effect_line(name, capsys):
    """A YAML that sets no AReaL-only field prints nothing: OmegaConf hands tuple defaults back as lists, which is
    the same setting, not a change."""
    from areal_lite.kit.trainer.train import TrainConfig

    areal_only._reported.clear()
    for profile in ("cpu", "gpu"):
        kit.load_expr_config(["--config", os.path.join(ROOT, "configs", name), f"profile={profile}"], TrainConfig,
                             verbose=False)  # fmt: skip
    assert "has no effect" not in capsys.readouterr().out


def test_to_areal_config_keeps_apart_only_what_areal_lacks():
    """Every key `to_areal_config` lists as kit-only is really missing from AReaL's config (a list of AReaL specs,
    such as `scheduling_spec`, is copied, not set aside)."""
    import typing

    from areal.api.cli_args import GRPOConfig as AReaLGRPOConfig

    from areal_lite.kit.areal.config import to_areal_config

    def areal_has(cls, dotted):
        head, _, rest = dotted.partition(".")
        fields = {f.name for f in dataclasses.fields(cls)}
        if head not in fields:
            return False
        if not rest:
            return True
        hint = typing.get_type_hints(cls)[head]
        sub = next((c for c in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(c)), None)
        return sub is not None and areal_has(sub, rest)

    _, kit_only = to_areal_config(os.path.join(ROOT, "configs", "search_agent.yaml"), profile="cpu")
    # A dataset's `type` is the one name with another meaning (the kit's packaged data; AReaL's training method).
    same_name_other_meaning = {"train_dataset.type", "valid_dataset.type"}
    assert kit_only and not [k for k in kit_only if areal_has(AReaLGRPOConfig, k) and k not in same_name_other_meaning]
