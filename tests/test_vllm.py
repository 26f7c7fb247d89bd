"""The vLLM backend against a real vLLM server (`make test-vllm`; marker `vllm`, left out of `make test`).

Needs the opt-in install (`make vllm`: `.venv-vllm`); skipped without it. The model is SmolLM2-135M-Instruct: the
tiny test model's head_dim of 16 is refused by vLLM's CPU attention, and SmolLM2 has tied embeddings, the case
where vLLM's own weight reload is wrong. What is checked, each against something independent of vLLM:
- greedy generation token-identical to the embedded server, logprobs within 1e-4, with and without stop strings;
- sampled logprobs equal a forward pass at the sampling temperature (the documented logprobs mode);
- a disk weight update that changes only the (tied) embedding makes the outputs those of the new weights (a
  forward pass of the new model, prefix cache included), and updating back restores the first outputs exactly;
- pause (abort) mid-generation, then resume: the request finishes seamlessly with both versions recorded;
  destroy() aborts in-flight requests by the ids the client knows (they come back with partial output);
- notebook 07 end to end with `AREAL_LITE_OVERRIDES="backend=vllm"` (servers launched by the notebook's `train`);
- a LoRA actor's adapter sync served by vLLM (`enable_lora`): the actor's own forward pass, version after version.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest
import torch

from areal_lite.api.cli_args import VLLM_LORA_RANKS, GenerationHyperparameters, InferenceEngineConfig, vLLMConfig
from areal_lite.api.io_struct import ModelRequest, WeightUpdateMeta
from areal_lite.engine.sglang_remote import RemoteSGLangEngine
from areal_lite.engine.vllm_client import VLLMClient
from areal_lite.engine.vllm_remote import RemotevLLMEngine
from areal_lite.infra.remote_inf_engine import EngineError
from areal_lite.kit.server.launch import _vllm_python, launch_server
from areal_lite.kit.server.procs import ServerLaunchError, server_log_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _have_vllm() -> bool:
    try:
        _vllm_python(vLLMConfig())
        return True
    except ServerLaunchError:
        return False


pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not _have_vllm(), reason="vLLM is not installed: `make vllm` (make test-vllm does it)"),
]

QUESTIONS = [
    "What is 2 + 3? Reply with just the number.",
    "Name three colours.",
    "Write one sentence about the sea.",
    "What is the capital of France? Explain in two sentences.",
]


def _config() -> InferenceEngineConfig:
    return InferenceEngineConfig(request_timeout=600.0, setup_timeout=300.0, pause_poll_interval=0.01)


def _tree_rss_gb(pid: int) -> float:
    proc = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]) / 2**30


def _generate(engine, prompt, gconfig, rid=None) -> object:
    req = ModelRequest(input_ids=list(prompt), gconfig=gconfig)
    if rid is not None:
        req.rid = rid
    return asyncio.run(engine.agenerate(req))


def _greedy(n: int, **kw) -> GenerationHyperparameters:
    return GenerationHyperparameters(max_new_tokens=n, greedy=True, **kw)


@pytest.fixture(scope="module")
def tokenizer(smollm_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_path)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    from areal_lite.utils.hf_utils import chat_prompt_ids

    return [chat_prompt_ids(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def hf_model(smollm_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm_path, dtype=torch.float32).eval()


def _forward_logprobs(model, prompt, output, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) of each output token under `model`, teacher-forced."""
    ids = torch.tensor([list(prompt) + list(output)])
    with torch.no_grad():
        logits = model(ids).logits[0].float() / temperature
    logp = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[0, 1:, None])[:, 0]
    return logp[len(prompt) - 1 :]


@pytest.fixture(scope="module")
def vllm_server(smollm_path):
    start = time.monotonic()
    handle = launch_server(vLLMConfig(model=smollm_path, dtype="float32", threads=1), backend="vllm")
    try:
        handle.wait_ready(timeout=600)
        handle.start_seconds = time.monotonic() - start
        print(f"\nvLLM server ready in {handle.start_seconds:.1f} s, RSS {_tree_rss_gb(handle.proc.pid):.2f} GB")
        yield handle
    finally:
        handle.stop()


@pytest.fixture
def vllm_engine(vllm_server):
    engine = RemotevLLMEngine(_config()).initialize(addr=vllm_server.address)
    yield engine
    engine.destroy()


# ------------------------------------------------------------------------------------------------ notebook (first:
# it starts its own servers, so it runs before this module's server exists)


def test_notebook_07_runs_on_vllm(tmp_path):
    env = dict(os.environ, AREAL_LITE_OVERRIDES="backend=vllm", OMP_NUM_THREADS="1", MPLBACKEND="Agg")
    started = time.time()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax",
           "--nbval-sanitize-with", "notebooks/sanitize.cfg", "notebooks/en/07_async_vs_sync.ipynb"]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    # every server the kit launches logs to server_log_path()'s folder (the temp folder's, not the run's: 97f46d6)
    log_dir = os.path.dirname(server_log_path("vllm", 0))
    logs = glob.glob(os.path.join(log_dir, "vllm-*.log"))
    assert [p for p in logs if os.path.getmtime(p) >= started], "the notebook did not launch vLLM"


# ------------------------------------------------------------------------------------------------ launch, detection


def test_launch_command_and_protocol_detection(vllm_server, smollm_server):
    cmd = vllm_server.cmd
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    for flag in ("--enforce-eager", "--worker-extension-cls", "--kv-cache-memory-bytes"):
        assert flag in cmd
    assert cmd[cmd.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert cmd[cmd.index("--dtype") + 1] == "float32"

    auto = RemoteSGLangEngine(_config()).initialize(addr=vllm_server.address)
    try:  # a notebook's RemoteSGLangEngine speaks vLLM when the server is vLLM
        assert isinstance(auto._client, VLLMClient)
    finally:
        auto.destroy()
    with pytest.raises(EngineError, match="not a vLLM server"):
        RemotevLLMEngine(_config()).initialize(addr=smollm_server.address)


# ------------------------------------------------------------------------------------------------ parity


@pytest.mark.parametrize("stop", [None, ["."]], ids=["plain", "stop-string"])
def test_greedy_parity_with_embedded_server(vllm_engine, smollm_server, prompts, tokenizer, stop):
    embedded = RemoteSGLangEngine(_config()).initialize(addr=smollm_server.address)
    try:
        worst, stopped_by_string = 0.0, 0
        for prompt in prompts:
            g = _greedy(48, stop=stop) if stop else _greedy(48)
            ours, theirs = _generate(vllm_engine, prompt, g), _generate(embedded, prompt, g)
            assert ours.output_tokens == theirs.output_tokens, tokenizer.decode(ours.output_tokens)
            assert ours.stop_reason == theirs.stop_reason
            assert ours.output_versions == [0] * ours.output_len
            worst = max(worst, max(abs(a - b) for a, b in zip(ours.output_logprobs, theirs.output_logprobs)))
            text = tokenizer.decode(ours.output_tokens)
            if stop and ours.stop_reason == "stop" and text.rstrip().endswith("."):
                stopped_by_string += 1
        print(f"\nlargest logprob difference vLLM vs embedded ({'stop' if stop else 'plain'}): {worst:.2e}")
        assert worst < 1e-4
        if stop:
            assert stopped_by_string >= 2, "the stop string never ended a generation"
    finally:
        embedded.destroy()


def test_sampled_logprobs_are_taken_after_temperature(vllm_engine, prompts, hf_model):
    g = GenerationHyperparameters(max_new_tokens=32, temperature=0.7)
    resp = _generate(vllm_engine, prompts[1], g)
    ours = torch.tensor(resp.output_logprobs)
    at_t = _forward_logprobs(hf_model, prompts[1], resp.output_tokens, temperature=0.7)
    at_1 = _forward_logprobs(hf_model, prompts[1], resp.output_tokens, temperature=1.0)
    assert (ours - at_t).abs().max().item() < 1e-3
    assert (ours - at_1).abs().max().item() > 1e-2  # and not before temperature (vLLM's default)


# ------------------------------------------------------------------------------------------------ weights


@pytest.fixture(scope="module")
def perturbed_smollm(smollm_path, tmp_path_factory):
    """SmolLM2 with only its embedding changed: the tied output layer must follow it, or outputs are wrong."""
    from safetensors.torch import load_file, save_file

    out = str(tmp_path_factory.mktemp("perturbed") / "smollm2-perturbed")
    shutil.copytree(smollm_path, out)
    (weights,) = glob.glob(os.path.join(out, "*.safetensors"))
    state = load_file(weights)
    (name,) = [k for k in state if k.endswith("embed_tokens.weight")]
    gen = torch.Generator().manual_seed(0)
    emb = state[name]
    state[name] = (emb + 0.5 * emb.std() * torch.randn(emb.shape, generator=gen, dtype=emb.dtype)).contiguous()
    state = {k: v.contiguous() for k, v in state.items()}
    save_file(state, weights, metadata={"format": "pt"})
    return out


def test_weight_update_changes_then_restores_outputs(vllm_engine, smollm_path, perturbed_smollm, prompts, tmp_path):
    from transformers import AutoModelForCausalLM

    long_prompt = prompts[3] + prompts[2] + prompts[1] + prompts[0]  # >16 tokens: whole cached prefix blocks
    g = _greedy(24, ignore_eos=True)
    before = [_generate(vllm_engine, p, g) for p in (prompts[0], long_prompt)]

    new_model = AutoModelForCausalLM.from_pretrained(perturbed_smollm, dtype=torch.float32).eval()
    meta = WeightUpdateMeta.from_disk(path=str(tmp_path / "w"))
    os.makedirs(os.path.dirname(meta.dir_for(1)), exist_ok=True)
    shutil.copytree(perturbed_smollm, meta.dir_for(1))
    vllm_engine.pause()
    t0 = time.monotonic()
    assert vllm_engine.update_weights(meta).result(timeout=300) == 1
    print(f"\nweight update (pause -> loaded): {time.monotonic() - t0:.2f} s")
    vllm_engine.set_version(1)
    vllm_engine.resume()

    for prompt, old in zip((prompts[0], long_prompt), before):
        new = _generate(vllm_engine, prompt, g)
        assert new.output_tokens != old.output_tokens
        assert new.output_versions == [1] * new.output_len
        # The new model's own forward pass: the (tied) output layer and the prefix cache follow the update.
        diff = (torch.tensor(new.output_logprobs) - _forward_logprobs(new_model, prompt, new.output_tokens)).abs()
        assert diff.max().item() < 1e-3, f"vLLM serves something else than the new weights ({diff.max():.3g})"

    shutil.copytree(smollm_path, meta.dir_for(2))
    assert vllm_engine.update_weights(meta).result(timeout=300) == 2  # not paused: drains, loads, resumes
    vllm_engine.set_version(2)
    for prompt, old in zip((prompts[0], long_prompt), before):
        again = _generate(vllm_engine, prompt, g)
        assert again.output_tokens == old.output_tokens
        assert again.output_logprobs == pytest.approx(old.output_logprobs, abs=1e-4)


# ------------------------------------------------------------------------------------------------ pause, abort


def _generated_tokens(addr: str) -> float:
    """vLLM's Prometheus counter of generated tokens (to interrupt mid-generation by data, not by a sleep)."""
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(m) for m in re.findall(r"^vllm:generation_tokens_total(?:\{[^}]*\})? (\S+)$", text, re.M))


async def _until_generated(addr: str, count: int, timeout: float = 120.0) -> None:
    start = await asyncio.to_thread(_generated_tokens, addr)
    deadline = time.monotonic() + timeout
    while await asyncio.to_thread(_generated_tokens, addr) < start + count:
        assert time.monotonic() < deadline, "the server generated nothing"
        await asyncio.sleep(0.05)


def test_pause_mid_generation_resumes_with_new_version(vllm_engine, vllm_server, prompts):
    n = 160
    g = _greedy(n, ignore_eos=True)
    reference = _generate(vllm_engine, prompts[2], g)

    async def scenario():
        progress = asyncio.ensure_future(_until_generated(vllm_server.address, 20))
        task = asyncio.ensure_future(vllm_engine.agenerate(ModelRequest(input_ids=prompts[2], gconfig=g)))
        await progress
        await asyncio.to_thread(vllm_engine.pause)
        vllm_engine.set_version(vllm_engine.get_version() + 1)
        await asyncio.sleep(0.5)
        assert not task.done()  # the aborted request waits while the engine is paused
        await asyncio.to_thread(vllm_engine.resume)
        return await task

    v0 = vllm_engine.get_version()
    resp = asyncio.run(scenario())
    assert resp.stop_reason == "length"
    assert resp.output_len == len(resp.output_logprobs) == len(resp.output_versions) == n
    k = resp.output_versions.index(v0 + 1)
    assert 0 < k < n, "the pause did not land mid-generation"
    assert resp.output_versions == [v0] * k + [v0 + 1] * (n - k)
    assert resp.output_tokens == reference.output_tokens  # greedy: the resumed request continues seamlessly
    assert resp.output_logprobs == pytest.approx(reference.output_logprobs, abs=1e-4)


def test_destroy_aborts_inflight_requests_by_their_ids(vllm_server, prompts):
    engine = RemotevLLMEngine(_config()).initialize(addr=vllm_server.address)
    n = 2000
    req = ModelRequest(input_ids=prompts[2], gconfig=_greedy(n, ignore_eos=True))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(asyncio.run, engine.agenerate(req))
        asyncio.run(_until_generated(vllm_server.address, 10))
        t0 = time.monotonic()
        engine.destroy()
        resp = fut.result(timeout=30)
    # Aborted on the server by id, so it came back at once with the tokens generated so far (a request the server
    # kept running would have been cancelled after the grace period, with no tokens).
    assert resp.stop_reason == "abort"
    assert 0 < resp.output_len < n
    assert time.monotonic() - t0 < 5.0


# ------------------------------------------------------------------------------------------------ LoRA


def test_the_lora_ranks_the_config_allows_are_vllms_own():
    """`cli_args.VLLM_LORA_RANKS` (the config loader refuses other `vllm.max_lora_rank`s) against vLLM's type."""
    code = "import typing; from vllm.config.lora import MaxLoRARanks; print(list(typing.get_args(MaxLoRARanks)))"
    run = subprocess.run([_vllm_python(vLLMConfig()), "-c", code], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert tuple(json.loads(run.stdout.strip().splitlines()[-1])) == VLLM_LORA_RANKS


def _policy_logprobs(actor, prompt, output) -> torch.Tensor:
    """The LoRA actor's own (peft) log-probs of `output` after `prompt`, teacher-forced."""
    was = actor.model.training
    actor.model.eval()
    try:
        return _forward_logprobs(actor.model, prompt, output)
    finally:
        actor.model.train(was)


def test_the_trainers_lora_sync_is_what_vllm_serves(smollm_path, prompts, hf_model, tmp_path):
    """A LoRA actor's own sync (`connect_engine`, `update_weights`) into vLLM launched with `enable_lora`: a request
    naming the version gets the log-probs of the actor's own forward pass (not the base model's); the next version
    replaces it, the version `lora_keep_versions` back is unloaded, and the base model is still served unchanged."""
    from areal_lite.api.cli_args import PPOActorConfig
    from areal_lite.engine.fsdp_engine import FSDPPPOActor

    cfg = vLLMConfig(model=smollm_path, dtype="float32", threads=1, enable_lora=True, max_lora_rank=16)
    handle = launch_server(cfg, backend="vllm")
    engines, actor = [], None
    try:
        handle.wait_ready(timeout=600)
        base = RemotevLLMEngine(_config()).initialize(addr=handle.address)
        engines.append(base)
        lora_cfg = InferenceEngineConfig(request_timeout=600.0, setup_timeout=300.0, use_lora=True)
        engine = RemotevLLMEngine(lora_cfg).initialize(addr=handle.address)
        engines.append(engine)
        lora = dict(use_lora=True, lora_rank=16, lora_alpha=32)
        actor = FSDPPPOActor(PPOActorConfig(path=smollm_path, dtype="float32", device="cpu", threads=1, **lora))
        actor.initialize(None)
        w = str(tmp_path / "w")
        meta = WeightUpdateMeta.from_disk(path=w, use_lora=True, lora_name="pol", lora_keep_versions=1)
        actor.connect_engine(engine, meta)
        g, chosen = _greedy(16, ignore_eos=True, lora_name="pol"), prompts[:2]
        before = [_generate(base, p, _greedy(16, ignore_eos=True)).output_tokens for p in chosen]
        for version in (1, 2):
            gen = torch.Generator().manual_seed(version)
            with torch.no_grad():  # peft starts B at 0, a no-op adapter: a random one changes what is generated
                for name, p in actor.model.named_parameters():
                    if "lora_B" in name:
                        p.copy_(0.02 * torch.randn(p.shape, generator=gen))
            actor.update_weights(meta)
            actor.set_version(version)
            engine.set_version(version)
            for prompt in chosen:
                out = _generate(engine, prompt, g)
                assert out.output_versions == [version] * out.output_len
                served = torch.tensor(out.output_logprobs)
                diff = (served - _policy_logprobs(actor, prompt, out.output_tokens)).abs().max().item()
                assert diff < 1e-3, f"vLLM serves another adapter than version {version}'s ({diff:.3g})"
                moved = (served - _forward_logprobs(hf_model, prompt, out.output_tokens)).abs().max().item()
                assert moved > 1e-2, f"version {version}'s adapter changed nothing ({moved:.3g})"
        with urllib.request.urlopen(f"http://{handle.address}/v1/models", timeout=30) as r:
            served = {m["id"] for m in json.load(r)["data"]}
        assert "pol-v2" in served and "pol-v1" not in served  # lora_keep_versions=1: version 1 unloaded
        assert [_generate(base, p, _greedy(16, ignore_eos=True)).output_tokens for p in chosen] == before
    finally:
        for e in engines:
            e.destroy()
        if actor is not None:
            actor.destroy()
        handle.stop()


def test_a_lora_sync_to_a_server_launched_without_adapters_says_how_to_start_one(vllm_server, tmp_path):
    """vLLM started without `--enable-lora` has no adapter routes: the update fails with how to start it."""
    cfg = InferenceEngineConfig(request_timeout=60.0, setup_timeout=300.0, use_lora=True)
    engine = RemotevLLMEngine(cfg).initialize(addr=vllm_server.address)
    try:
        meta = WeightUpdateMeta.from_disk(path=str(tmp_path / "w"), use_lora=True, lora_name="pol")
        os.makedirs(meta.dir_for(1))
        with pytest.raises(EngineError, match="HTTP 404.*--enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"):
            engine.update_weights(meta).result(timeout=120)
    finally:
        engine.destroy()
