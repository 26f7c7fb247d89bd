"""GPU-only tests, run by `make test-gpu` (marker `gpu`; `make test` leaves them out).

The CUDA paths the CPU suite cannot reach: the actor in bfloat16 on a GPU (full and LoRA), the embedded server on
CUDA (with an adapter synced to it), and the multi-process paths over NCCL (the weight broadcast and FSDP2), which
need two GPUs: NCCL refuses two ranks on one device, so on a one-GPU machine those two say so and skip. Without any
CUDA device every test here fails with one line: `make test-gpu` is the command that promised a GPU.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
import torch
from test_actor import FSDP_SCRIPT, RECEIVER, child_env, make_batch, run_fsdp_steps
from test_lora import PROMPTS as LORA_PROMPTS
from test_lora import check_a_ppo_step_moves_only_the_adapter, greedy_outputs, perturb_adapter
from test_serve import PROMPTS, call, forward_logprobs, generate

from areal_lite.api.cli_args import (
    EmbeddedServerConfig,
    GenerationHyperparameters,
    InferenceEngineConfig,
    OptimizerConfig,
    PPOActorConfig,
)
from areal_lite.api.io_struct import ModelRequest, WeightUpdateMeta
from areal_lite.engine.fsdp_engine import FSDPPPOActor
from areal_lite.engine.fsdp_utils.weights import init_custom_process_group
from areal_lite.engine.sglang_remote import RemoteSGLangEngine

pytestmark = pytest.mark.gpu
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs (one rank per device)")


@pytest.fixture(autouse=True)
def cuda():
    assert torch.cuda.is_available(), "the gpu tests need a CUDA device: run them with `make test-gpu` on a GPU"


def test_bf16_actor_on_cuda_trains_and_writes_loadable_weights(tiny_model_path, vocab, tmp_path):
    """dtype="bfloat16" on CUDA: float32 master weights under bf16 autocast, so a step at the GPU configs' learning
    rate (1e-6) moves the weights (bf16 weights would round it away)."""
    batch = make_batch(vocab, B=6, seed=3)
    cpu = FSDPPPOActor(PPOActorConfig(path=tiny_model_path, device="cpu", dtype="float32", threads=1)).initialize()
    want = cpu.compute_logp(batch)
    actor = FSDPPPOActor(
        PPOActorConfig(path=tiny_model_path, device="cuda", dtype="bfloat16", optimizer=OptimizerConfig(lr=1e-6))
    ).initialize()
    assert next(actor.model.parameters()).is_cuda and next(actor.model.parameters()).dtype == torch.float32
    got = actor.compute_logp(batch)
    assert got.device == batch["input_ids"].device  # results come back where the batch lives
    assert (got - want).abs().max().item() < 0.15  # bfloat16 has 8 bits of mantissa
    batch["prox_logp"] = got
    batch["logprobs"] = got * batch["loss_mask"]
    actor.compute_advantages(batch)
    before = {n: p.detach().float().cpu().clone() for n, p in actor.model.named_parameters()}
    stats = actor.ppo_update(batch)
    assert stats["skipped"] == 0 and torch.isfinite(torch.tensor(stats["grad_norm"]))
    layers = [(n, p.detach().float().cpu()) for n, p in actor.model.named_parameters() if ".layers." in n]
    changed = sum(int((p != before[n]).sum()) for n, p in layers) / sum(p.numel() for _, p in layers)
    assert changed > 0.9, changed  # float32 on a CPU: all; the same step rounded to bf16 weights: about 4 %
    meta = WeightUpdateMeta.from_disk(path=str(tmp_path / "w"))
    actor.update_weights(meta)
    from safetensors.torch import load_file

    saved = load_file(os.path.join(meta.dir_for(1), "model.safetensors"))
    for n, p in actor.model.named_parameters():
        torch.testing.assert_close(saved[n].float(), p.detach().float().cpu(), atol=0, rtol=0)
    actor.destroy()
    cpu.destroy()


def test_embedded_server_on_cuda_logprobs_equal_forward_pass(tiny_model_path):
    from transformers import AutoModelForCausalLM

    from areal_lite.kit.server.launch import launch_server

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    handle = launch_server(EmbeddedServerConfig(model_path=tiny_model_path, device="cuda"), backend="embedded")
    try:
        handle.wait_ready(timeout=300)
        body = {
            "input_ids": PROMPTS,
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 10, "temperature": 0.7, "ignore_eos": True},
        }
        for prompt, out in zip(PROMPTS, generate(handle.address, body)):
            got = torch.tensor([e[0] for e in out["meta_info"]["output_token_logprobs"]])
            want = forward_logprobs(model, prompt, out["output_ids"], 0.7)
            assert (got - want).abs().max().item() < 1e-2, (got, want)  # CUDA kernels differ from CPU ones
    finally:
        handle.stop()


def test_lora_bf16_actor_on_cuda_trains_the_adapter_and_the_cuda_server_serves_it(tiny_model_path, vocab, tmp_path):
    """LoRA on a GPU: the bf16 actor's PPO step moves only the adapter; the adapter alone is synced to the embedded
    server on CUDA, which then generates with the merged weights (its log-probs are those of peft's merged model)
    and gives the base model's generations back once the adapter is unloaded."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from areal_lite.kit.server.launch import launch_server

    lora = dict(use_lora=True, lora_rank=4, lora_alpha=8, optimizer=OptimizerConfig(lr=1e-2))
    actor = FSDPPPOActor(PPOActorConfig(path=tiny_model_path, device="cuda", dtype="bfloat16", **lora)).initialize()
    check_a_ppo_step_moves_only_the_adapter(actor, vocab, seed=3)

    perturb_adapter(actor)  # a large adapter, so that generations surely change
    handle = launch_server(EmbeddedServerConfig(model_path=tiny_model_path, device="cuda"), backend="embedded")
    engine = None
    try:
        handle.wait_ready(timeout=300)
        addr, n = handle.address, 10
        before = greedy_outputs(addr, n)
        meta = WeightUpdateMeta.from_disk(path=str(tmp_path / "w"), use_lora=True, lora_name="pol")
        engine = RemoteSGLangEngine(InferenceEngineConfig(use_lora=True)).initialize(addr=addr)
        actor.connect_engine(engine, meta)
        actor.update_weights(meta)
        actor.set_version(1)
        engine.set_version(1)
        assert call(addr, "/server_info")[1]["lora_adapter"] == "pol-v1"
        merged = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
        merged = PeftModel.from_pretrained(merged, meta.dir_for(1)).merge_and_unload().eval()
        g = GenerationHyperparameters(max_new_tokens=n, greedy=True, ignore_eos=True, lora_name="pol")
        changed = False
        for prompt, old in zip(LORA_PROMPTS, before):
            resp = asyncio.run(engine.agenerate(ModelRequest(input_ids=prompt, gconfig=g)))
            want = forward_logprobs(merged, prompt, resp.output_tokens)
            got = torch.tensor(resp.output_logprobs)
            assert (got - want).abs().max().item() < 1e-2, (got, want)
            changed |= resp.output_tokens != old
        assert changed, "the adapter changed no generation"
        status, out = call(addr, "/unload_lora_adapter", {"lora_name": "pol-v1"})
        assert status == 200 and out["loaded_adapters"] == {}
        assert greedy_outputs(addr, n) == before
    finally:
        if engine is not None:
            engine.destroy()
        handle.stop()
        actor.destroy()


@two_gpus
def test_nccl_weight_broadcast_reaches_a_receiver_on_another_gpu(tiny_model_path, tmp_path):
    import torch.distributed as dist

    from areal_lite.kit.server.procs import find_free_port

    addr = f"tcp://127.0.0.1:{find_free_port()}"
    script = tmp_path / "receiver.py"
    script.write_text(
        RECEIVER.replace('"gloo"', '"nccl"').replace(
            "model = AutoModelForCausalLM.from_pretrained(path)",
            "torch.cuda.set_device(1); model = AutoModelForCausalLM.from_pretrained(path).cuda()",
        )
    )
    env = child_env(one_thread=False)  # the GPU processes keep their OpenMP threads
    out = tmp_path / "received"
    actor = FSDPPPOActor(PPOActorConfig(path=tiny_model_path, device="cuda:0")).initialize()
    with torch.no_grad():
        for p in actor.model.parameters():
            p.add_(0.01)  # weights the receiver does not have yet
    proc = subprocess.Popen(
        [sys.executable, str(script), addr, tiny_model_path, str(out)], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        group = init_custom_process_group("nccl", addr, world_size=2, rank=0, group_name=f"weights-{addr}")
        actor._broadcast_params(group)
        assert proc.wait(timeout=300) == 0, proc.stderr.read()[-3000:]
        dist.destroy_process_group(group)
    finally:
        proc.kill()
    from transformers import AutoModelForCausalLM

    received = AutoModelForCausalLM.from_pretrained(str(out))
    for n, p in actor.model.named_parameters():
        torch.testing.assert_close(received.get_parameter(n), p.detach().cpu(), atol=0, rtol=0)
    actor.destroy()


@two_gpus
def test_fsdp2_on_two_gpus_equals_one_gpu(tiny_model_path, vocab, tmp_path):
    env = child_env(one_thread=False)  # the GPU processes keep their OpenMP threads
    script = FSDP_SCRIPT.replace('device="cpu"', 'device="cuda"')
    results = run_fsdp_steps(script, tiny_model_path, vocab, tmp_path, env, 600, torchrun_alone=True)
    one, two = results[1], results[2]
    for k in one["state"]:
        torch.testing.assert_close(two["state"][k].cpu(), one["state"][k].cpu(), atol=1e-4, rtol=0)
    assert two["stats"]["loss"] == pytest.approx(one["stats"]["loss"], rel=1e-3, abs=1e-5)
