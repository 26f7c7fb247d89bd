"""`make areal-run`: notebook 08's export trains under AReaL 1.0.4's own trainer on CPU (kit/areal/run.py).

The whole run (~5 min) is marked `areal_run` and runs in `make areal-run`, not in `make test`. The parts it stands
on are checked here against the real AReaL: its loader accepts every CPU override, the Qwen2 layout of a Llama
model computes the same logits, and the per-step numbers are read back from AReaL's own table printer.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_areals_loader_takes_the_cpu_overrides(tmp_path):
    from areal.api.cli_args import GRPOConfig, load_expr_config

    from areal_lite.kit.areal.config import to_areal_config
    from areal_lite.kit.areal.run import cpu_overrides

    areal_dict, _ = to_areal_config(os.path.join(ROOT, "configs", "search_agent.yaml"), profile="cpu")
    path = tmp_path / "search_agent_cpu.yaml"
    path.write_text(json.dumps(areal_dict))
    overrides = cpu_overrides("/models/m", rows_per_step=8, fileroot=str(tmp_path / "run"), steps=2)
    config, _ = load_expr_config(["--config", str(path), *overrides], GRPOConfig)
    assert (config.actor.path, config.tokenizer_path) == ("/models/m", "/models/m")
    assert (config.actor.attn_impl, config.actor.weight_update_mode) == ("sdpa", "disk")
    assert config.actor.mb_spec.n_mbs == 8 and config.total_train_steps == 2
    assert (config.recover.mode, config.recover.freq_steps) == ("on", 1)
    assert config.cluster.name_resolve.nfs_record_root.startswith(str(tmp_path / "run"))


def test_qwen2_layout_of_a_llama_computes_the_same_logits(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from areal_lite.utils.model_store import as_qwen2_layout

    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True, rope_parameters={"rope_type": "default",
                      "rope_theta": 10000.0})  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    out = as_qwen2_layout(str(tmp_path / "llama"))
    ids = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(1))
    llama = AutoModelForCausalLM.from_pretrained(tmp_path / "llama", dtype=torch.float32)
    qwen = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert qwen.config.model_type == "qwen2"
    with torch.no_grad():
        torch.testing.assert_close(qwen(ids).logits, llama(ids).logits, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="expected a Llama"):
        as_qwen2_layout(out)  # already Qwen2: nothing to convert


def test_step_numbers_are_read_from_areals_own_table():
    from areal.utils.printing import tabulate_stats

    from areal_lite.kit.areal.run import SHOWN, parse_steps

    steps = {3: {SHOWN["reward"]: 0.125, SHOWN["loss"]: -0.0390625, "ppo_actor/n_seqs": 8.0, "a/b": 1e-7},
             4: {SHOWN["reward"]: 0.5, SHOWN["loss"]: 0.25, SHOWN["step_s"]: 51.5}}  # fmt: skip
    log = "".join(
        f"\x1b[92m(AReaL) StatsLogger INFO: Epoch 1/1 Step {s}/88 Train step {s}/88 done.\x1b[0m\n"
        f"(AReaL) StatsLogger INFO: \n{tabulate_stats(stats)}\nsome other line\n"
        for s, stats in steps.items()
    )
    got = parse_steps(log)
    assert got.keys() == steps.keys()
    for s, stats in steps.items():
        assert got[s] == pytest.approx(stats, rel=1e-4)


@pytest.mark.areal_run
def test_the_export_trains_two_steps_under_areal_and_resumes():
    """What `make areal-run` runs (needs notebook 08's export in runs/areal_export)."""
    from areal_lite.kit.areal.run import main

    export = os.path.join(ROOT, "runs", "areal_export")
    if not os.path.exists(os.path.join(export, "search_agent_areal.py")):
        pytest.fail("no export: run notebook 08 first (make areal-run does)")
    assert main(["--export", export]) == 0
