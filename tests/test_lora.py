"""LoRA with AReaL 1.0.4's names, end to end on the tiny model: the actor trains only a peft adapter, syncs the
adapter alone, the embedded server merges it (`/load_lora_adapter`) and generates exactly what the trainer's merged
model generates; bad adapters and bodies get 4xx; checkpoints keep the adapter; `train()` runs and resumes with it;
AReaL's LoRA fields load from YAML."""

from __future__ import annotations

import json
import os

import pytest
import torch
from test_actor import fill_logprobs, make_batch
from test_serve import call, generate, greedy

from areal_lite.api.cli_args import (
    ConfigError,
    EmbeddedServerConfig,
    GenerationHyperparameters,
    InferenceEngineConfig,
    OptimizerConfig,
    PPOActorConfig,
    SaverConfig,
    load_expr_config,
)
from areal_lite.api.io_struct import ModelRequest, WeightUpdateMeta
from areal_lite.engine.fsdp_engine import FSDPPPOActor
from areal_lite.kit.server.protocol import parse_load_lora_body, parse_lora_paths, parse_unload_lora_body
from areal_lite.utils.jsonhttp import BadRequest

PROMPTS = [[11, 12, 13, 14, 15], [200, 201, 7], [3000, 17, 99, 512, 7, 8]]


def greedy_outputs(addr: str, n: int) -> list:
    """The server's greedy `n` tokens (EOS ignored) for each of PROMPTS: what its current weights generate."""
    return [generate(addr, greedy(p, n, sp={"ignore_eos": True}))["output_ids"] for p in PROMPTS]


def lora_actor(path: str, **kw) -> FSDPPPOActor:
    opt = kw.pop("optimizer", OptimizerConfig(lr=1e-2))
    lora = dict(use_lora=True, lora_rank=kw.pop("lora_rank", 4), lora_alpha=8)
    cfg = PPOActorConfig(path=path, device="cpu", threads=1, optimizer=opt, **lora, **kw)
    return FSDPPPOActor(cfg).initialize(None)


def perturb_adapter(actor: FSDPPPOActor, seed: int = 0, scale: float = 0.3) -> None:
    """Random B matrices (peft starts B at 0, which would make the adapter a no-op)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in actor.model.named_parameters():
            if "lora_B" in name:
                p.copy_(scale * torch.randn(p.shape, generator=g))


def adapter(actor: FSDPPPOActor) -> dict:
    return {n: p.detach().clone() for n, p in actor.model.named_parameters() if "lora_" in n}


def base(actor: FSDPPPOActor) -> dict:
    return {n: p.detach().clone() for n, p in actor.model.named_parameters() if "lora_" not in n}


def check_a_ppo_step_moves_only_the_adapter(actor: FSDPPPOActor, vocab: int, seed: int = 0) -> None:
    """One PPO step on a random batch: every base weight stays bit for bit, and some lora_B matrix moves."""
    batch = make_batch(vocab, B=4, seed=seed)
    fill_logprobs(actor, batch)
    batch["advantages"] = torch.randn(batch["input_ids"].shape, generator=torch.Generator().manual_seed(1))
    base0, lora0 = base(actor), adapter(actor)
    stats = actor.ppo_update(batch)
    assert stats["skipped"] == 0 and stats["grad_norm"] > 0
    assert all(torch.equal(base0[n], p) for n, p in base(actor).items()), "a base weight moved"
    moved = [n for n, p in adapter(actor).items() if not torch.equal(lora0[n], p)]
    assert any("lora_B" in n for n in moved), "the PPO step did not change the adapter"


# ----------------------------------------------------------------------------------------------------------------
# the actor


def test_only_the_adapter_trains_and_is_in_the_optimizer(tiny_model_path, vocab, capsys):
    actor = lora_actor(tiny_model_path)
    printed = capsys.readouterr().out
    assert "areal-lite: LoRA r=4 alpha=8 on " in printed and "q_proj" in printed and "trainable parameters" in printed
    trainable = {n for n, p in actor.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_A" in n or "lora_B" in n for n in trainable)
    assert not any("lm_head" in n or "embed" in n for n in trainable)  # all-linear: decoder layers only
    in_optimizer = {id(p) for group in actor.optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for p in actor.model.parameters() if p.requires_grad}

    check_a_ppo_step_moves_only_the_adapter(actor, vocab)
    actor.destroy()


def test_checkpoint_keeps_the_adapter_and_the_base_stays_the_base(tiny_model_path, tmp_path):
    actor = lora_actor(tiny_model_path)
    perturb_adapter(actor, seed=1)
    saved, base0 = adapter(actor), base(actor)
    actor.set_version(5)
    actor.save(str(tmp_path / "ckpt"))
    assert sorted(os.listdir(tmp_path / "ckpt" / "model")) == ["adapter_config.json", "adapter_model.safetensors"]
    perturb_adapter(actor, seed=2)
    actor.set_version(0)
    actor.load(str(tmp_path / "ckpt"))
    assert actor.get_version() == 5
    assert all(torch.equal(saved[n], p) for n, p in adapter(actor).items())
    assert all(torch.equal(base0[n], p) for n, p in base(actor).items())
    # A fresh actor (another process after a crash) restores the same adapter.
    other = lora_actor(tiny_model_path)
    other.load(str(tmp_path / "ckpt"))
    assert all(torch.equal(saved[n], p) for n, p in adapter(other).items())
    # An actor with another rank refuses the checkpoint with a message instead of loading half of it.
    wrong = lora_actor(tiny_model_path, lora_rank=2)
    with pytest.raises(RuntimeError, match="does not match this actor's LoRA"):
        wrong.load(str(tmp_path / "ckpt"))
    for a in (actor, other, wrong):
        a.destroy()


def test_a_meta_that_disagrees_with_the_actor_is_refused(tiny_model_path, tmp_path):
    actor = lora_actor(tiny_model_path)
    with pytest.raises(ValueError, match="WeightUpdateMeta.use_lora=False but actor.use_lora=True"):
        actor.update_weights(WeightUpdateMeta.from_disk(path=str(tmp_path)))
    actor.destroy()


# ----------------------------------------------------------------------------------------------------------------
# adapter sync to a real embedded server


@pytest.fixture(scope="module")
def lora_server(tiny_model_path):
    """A server of our own: these tests load and unload adapters (the shared one stays untouched)."""
    from areal_lite.kit.server.launch import launch_server

    handle = launch_server(EmbeddedServerConfig(model_path=tiny_model_path, threads=1), backend="embedded")
    try:
        handle.wait_ready(timeout=180)
        yield handle.address
    finally:
        handle.stop()


def merged_greedy(folder: str, tiny_model_path: str, prompt: list, n: int) -> tuple[list, list]:
    """Greedy tokens and their log-probs from the adapter folder merged by peft itself into a fresh base model:
    what AReaL (or anyone with peft) gets from the exported adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, folder).merge_and_unload().eval()
    ids, lps = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
            t = int(lp.argmax())
            ids.append(t)
            lps.append(float(lp[t]))
    return ids[len(prompt) :], lps


def test_adapter_sync_gives_the_trainers_merged_generations(lora_server, tiny_model_path, tmp_path):
    from areal_lite.engine.sglang_remote import RemoteSGLangEngine

    addr, n = lora_server, 10
    before = greedy_outputs(addr, n)
    actor = lora_actor(tiny_model_path)
    perturb_adapter(actor)
    meta = WeightUpdateMeta.from_disk(path=str(tmp_path / "w"), use_lora=True, lora_name="pol", lora_keep_versions=2)
    engine = RemoteSGLangEngine(InferenceEngineConfig(use_lora=True)).initialize(addr=addr)
    try:
        actor.connect_engine(engine, meta)
        actor.update_weights(meta)  # version 1: the engine posts /load_lora_adapter pol-v1
        actor.set_version(1)
        engine.set_version(1)
        folder = meta.dir_for(1)
        assert sorted(os.listdir(folder)) == ["adapter_config.json", "adapter_model.safetensors"]
        full = sum(p.numel() * p.element_size() for n_, p in actor.model.named_parameters() if "lora_" not in n_)
        assert 0 < actor.last_sync_bytes < full / 5, (actor.last_sync_bytes, full)
        info = call(addr, "/server_info")[1]
        assert info["lora_adapter"] == "pol-v1" and info["weight_version"] == "pol-v1"

        g = GenerationHyperparameters(max_new_tokens=n, greedy=True, ignore_eos=True, lora_name="pol")
        import asyncio

        for prompt in PROMPTS:
            resp = asyncio.run(engine.agenerate(ModelRequest(input_ids=prompt, gconfig=g)))
            want, want_lp = merged_greedy(folder, tiny_model_path, prompt, n)
            assert resp.output_tokens == want
            assert max(abs(a - b) for a, b in zip(resp.output_logprobs, want_lp)) < 1e-4
        assert any(
            asyncio.run(engine.agenerate(ModelRequest(input_ids=p, gconfig=g))).output_tokens != old
            for p, old in zip(PROMPTS, before)
        ), "the adapter changed no generation"

        # A stale adapter name is a 400 that names the loaded one; the server keeps serving.
        status, out = call(addr, "/generate", greedy(PROMPTS[0], 3, lora_path="pol-v0"))
        assert status == 400 and "'pol-v0' is not a loaded LoRA adapter" in out["error"] and "pol-v1" in out["error"]
        # Unloading puts the base weights back exactly.
        status, out = call(addr, "/unload_lora_adapter", {"lora_name": "pol-v1"})
        assert status == 200 and out == {"success": True, "error_message": None, "loaded_adapters": {}}
        after = greedy_outputs(addr, n)
        assert after == before
    finally:
        engine.destroy()
        actor.destroy()


def test_bad_adapters_and_bodies_get_4xx_and_the_server_keeps_serving(lora_server, tmp_path):
    addr = lora_server
    expect = generate(addr, greedy(PROMPTS[1], 6))["output_ids"]
    (tmp_path / "empty").mkdir()
    bad_cfg = tmp_path / "dora"
    bad_cfg.mkdir()
    dora = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "use_dora": True}
    (bad_cfg / "adapter_config.json").write_text(json.dumps(dora))
    not_json = tmp_path / "not_json"
    not_json.mkdir()
    (not_json / "adapter_config.json").write_text("{r: 4")
    for body, needle in [
        ({}, "lora_name"),
        ({"lora_name": "a"}, "lora_path"),
        ({"lora_name": 3, "lora_path": "x"}, "lora_name"),
        ({"lora_name": "a", "lora_path": str(tmp_path / "missing")}, "not a directory"),
        ({"lora_name": "a", "lora_path": str(tmp_path / "empty")}, "adapter_config.json"),
        ({"lora_name": "a", "lora_path": str(bad_cfg)}, "use_dora"),
        ({"lora_name": "a", "lora_path": str(not_json)}, f"{not_json / 'adapter_config.json'} is not valid JSON"),
        ({"lora_name": "a", "lora_path": "x", "pinned": "yes"}, "pinned"),
    ]:
        status, out = call(addr, "/load_lora_adapter", body)
        assert status == 400 and needle in out["error"], (body, out)
    status, out = call(addr, "/load_lora_adapter", raw=b"{not json")
    assert status == 400
    status, out = call(addr, "/unload_lora_adapter", {"lora_name": "never-loaded"})
    assert status == 400 and "not loaded" in out["error"]
    for lora_path in ("nope", 7, ""):
        status, out = call(addr, "/generate", greedy(PROMPTS[1], 3, lora_path=lora_path))
        assert status == 400 and "lora_path" in out["error"], out
    assert generate(addr, greedy(PROMPTS[1], 6))["output_ids"] == expect
    assert generate(addr, greedy(PROMPTS[1], 6, lora_path=None))["output_ids"] == expect


def test_lora_body_parsers():
    assert parse_load_lora_body({"lora_name": "a-v1", "lora_path": "/x", "pinned": False}).lora_path == "/x"
    assert parse_unload_lora_body({"lora_name": "a-v1"}).lora_path is None
    assert parse_lora_paths({"lora_path": "a"}, 3) == ["a", "a", "a"]
    assert parse_lora_paths({"lora_path": ["a", None]}, 2) == ["a", None]
    assert parse_lora_paths({}, 2) == [None, None]
    with pytest.raises(BadRequest, match="lora_path: got 1 values for 2 prompts"):
        parse_lora_paths({"lora_path": ["a"]}, 2)


# ----------------------------------------------------------------------------------------------------------------
# config and the training script


AREAL_LORA_YAML = """
experiment_name: lora-exp
trial_name: t0
backend: embedded
actor:
  path: {path}
  use_lora: true
  lora_rank: 8
  lora_alpha: 16
  target_modules: [q_proj, v_proj]
  peft_type: lora
rollout:
  use_lora: true
gconfig:
  lora_name: my-adapter
"""


def test_areals_lora_fields_load(tmp_path, tiny_model_path, capsys):
    from areal_lite.api import areal_only
    from areal_lite.kit.trainer.train import TrainConfig

    path = tmp_path / "lora.yaml"
    path.write_text(AREAL_LORA_YAML.format(path=tiny_model_path))
    areal_only._reported.clear()
    config, _ = load_expr_config(["--config", str(path), "profile=cpu"], TrainConfig, verbose=False)
    a = config.actor
    assert (a.use_lora, a.lora_rank, a.lora_alpha, a.peft_type) == (True, 8, 16, "lora")
    assert a.target_modules == ["q_proj", "v_proj"]
    assert config.rollout.use_lora and config.gconfig.lora_name == "my-adapter"
    assert "has no effect" not in capsys.readouterr().out
    with pytest.raises(ConfigError, match=r"actor.use_lora=True and rollout.use_lora=False disagree"):
        load_expr_config(["--config", str(path), "rollout.use_lora=false"], TrainConfig, verbose=False)
    with pytest.raises(ConfigError, match="backend vllm needs vllm.enable_lora=true"):
        load_expr_config(["--config", str(path), "backend=vllm"], TrainConfig, verbose=False)
    on_vllm = ["--config", str(path), "backend=vllm", "vllm.enable_lora=true"]
    config, _ = load_expr_config(on_vllm, TrainConfig, verbose=False)
    assert config.vllm.max_lora_rank == 16  # AReaL's default, room for rank 8
    with pytest.raises(ConfigError, match=r"vllm.max_lora_rank=12: vLLM accepts only 1, 8, 16, 32"):
        load_expr_config(on_vllm + ["vllm.max_lora_rank=12"], TrainConfig, verbose=False)
    with pytest.raises(ConfigError, match=r"vllm.max_lora_rank=1 is below actor.lora_rank=8: vLLM would refuse"):
        load_expr_config(on_vllm + ["vllm.max_lora_rank=1"], TrainConfig, verbose=False)
    with pytest.raises(ConfigError, match="sglang.enable_lora=true"):
        load_expr_config(["--config", str(path), "backend=sglang"], TrainConfig, verbose=False)
    on_sglang = ["--config", str(path), "backend=sglang", "sglang.enable_lora=true"]
    config, _ = load_expr_config(on_sglang, TrainConfig, verbose=False)
    assert config.sglang.max_lora_rank == 8  # unset: SGLang reserves room for the actor's rank
    config, _ = load_expr_config(on_sglang + ["sglang.max_lora_rank=16"], TrainConfig, verbose=False)
    assert config.sglang.max_lora_rank == 16
    with pytest.raises(ConfigError, match=r"sglang.max_lora_rank=4 is below actor.lora_rank=8"):
        load_expr_config(on_sglang + ["sglang.max_lora_rank=4"], TrainConfig, verbose=False)


def test_train_with_lora_end_to_end_and_resume(tmp_path, tiny_model_path):
    """`train()` with actor.use_lora: adapter-only syncs every step; a crash and --resume continue with the adapter
    (the restarted server has none until the resume pushes the checkpoint's)."""
    from test_train import make_config, read_jsonl, token_workflow

    from areal_lite.utils.model_store import load_tokenizer

    tok = load_tokenizer(tiny_model_path)
    cfg = make_config(tmp_path, tiny_model_path, steps=3, trial="lora", saver=SaverConfig(freq_steps=1), lr=1e-2)
    cfg.actor.use_lora = cfg.rollout.use_lora = True
    cfg.actor.lora_rank, cfg.actor.lora_alpha = 4, 8

    def crash(step, stats):
        if step == 1:
            raise KeyboardInterrupt("simulated crash")

    with pytest.raises(KeyboardInterrupt):
        train_(cfg, token_workflow(tok, cfg), crash)
    run_dir = tmp_path / "runs" / "e2e" / "lora"
    ckpt = run_dir / "checkpoints" / "step_000002" / "actor" / "model"
    assert sorted(os.listdir(ckpt)) == ["adapter_config.json", "adapter_model.safetensors"]
    resumed = train_(cfg, token_workflow(tok, cfg), None, resume=True)
    logged = read_jsonl(run_dir / "stats.jsonl")
    assert [s["step"] for s in logged] == [0, 1, 2] and [s["version"] for s in logged] == [1, 2, 3]
    assert [s["step"] for s in resumed] == [0, 1, 2]
    full = os.path.getsize(os.path.join(tiny_model_path, "model.safetensors"))
    assert all(0 < s["weight_sync_bytes"] < full / 5 for s in logged), [s["weight_sync_bytes"] for s in logged]
    # Synchronous: the server sampled with the merged adapter the trainer recomputes.
    assert all(abs(s["behav_kl"]) < 1e-3 and s["skipped"] == 0 for s in logged), logged


def test_a_lora_run_on_a_used_server_starts_from_the_base_model(lora_server, tmp_path, tiny_model_path):
    """A server another run trained holds that run's weights; the adapter must not be merged onto them. The run
    below does not move its adapter (lr 0, so B stays 0): its server must then generate what the base model does."""
    from test_train import make_config, token_workflow
    from transformers import AutoModelForCausalLM

    from areal_lite.kit.trainer.train import train
    from areal_lite.utils.model_store import load_tokenizer

    addr, n = lora_server, 8
    status, _ = call(addr, "/update_weights_from_disk", {"model_path": tiny_model_path})
    assert status == 200
    want = greedy_outputs(addr, n)
    other = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for p in other.parameters():
            p.add_(0.5 * p.std() * torch.randn(p.shape, generator=g))
    other.save_pretrained(tmp_path / "other")
    try:
        assert call(addr, "/update_weights_from_disk", {"model_path": str(tmp_path / "other")})[0] == 200
        used = greedy_outputs(addr, n)
        assert used != want, "the other weights generate as the base does: the test proves nothing"

        cfg = make_config(tmp_path, tiny_model_path, steps=1, trial="used-server", lr=0.0)
        cfg.actor.use_lora = cfg.rollout.use_lora = True
        cfg.actor.lora_rank, cfg.actor.lora_alpha = 4, 8
        train(cfg, workflow=token_workflow(load_tokenizer(tiny_model_path), cfg), server_addrs=[addr], progress=False)
        got = greedy_outputs(addr, n)
        assert got == want
    finally:
        call(addr, "/update_weights_from_disk", {"model_path": tiny_model_path})  # the next tests' base


def train_(cfg, workflow, on_step, resume=False):
    from areal_lite.kit.trainer.train import train

    return train(cfg, resume=resume, workflow=workflow, on_step=on_step, progress=False)


def test_the_cli_trains_the_demo_config_with_lora(tmp_path, tiny_model_path, capsys):
    """`python -m areal_lite.kit.trainer.train --config configs/arith_grpo_demo.yaml actor.use_lora=true
    rollout.use_lora=true` (in-process): held-out evaluation runs through its own engine client, which must ask for
    the current adapter."""
    from areal_lite.kit.trainer.train import main

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    args = ["--config", os.path.join(root, "configs", "arith_grpo_demo.yaml"), f"actor.path={tiny_model_path}",
            f"tokenizer_path={tiny_model_path}", f"fileroot={tmp_path / 'runs'}", "total_train_steps=2",
            "gconfig.max_new_tokens=6", "eval_gconfig.max_new_tokens=6", "evaluator.size=4", "evaluator.freq_steps=1",
            "actor.threads=1", "embedded.threads=1", "gconfig.n_samples=2", "train_dataset.batch_size=2",
            "actor.use_lora=true", "rollout.use_lora=true", "actor.lora_rank=4"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "areal-lite: LoRA r=4 alpha=16" in out and "2 steps logged" in out
    rows = [json.loads(line) for line in open(tmp_path / "runs" / "arith-grpo-demo" / "run0" / "stats.jsonl")]
    assert [r["step"] for r in rows] == [0, 1] and all("eval_accuracy" in r for r in rows)
