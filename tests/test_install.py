"""The CPU install must not have pulled CUDA wheels (an unpinned torch brings gigabytes of nvidia-* packages)."""

import importlib.metadata
import os

import pytest


def test_no_cuda_wheels_in_cpu_install():
    if os.environ.get("AREAL_LITE_GPU_INSTALL") == "1":
        pytest.skip("GPU install: CUDA wheels are expected (set by tools/test_gpu.sh)")
    # nvidia-ml-py is NVML's pure-Python binding (tens of kB, no CUDA), required by AReaL and SGLang's imports.
    allowed = {"nvidia-ml-py"}
    cuda = sorted(
        d.metadata["Name"]
        for d in importlib.metadata.distributions()
        if (d.metadata["Name"] or "").lower().startswith(("nvidia-", "nvidia_", "triton", "cuda-"))
        and d.metadata["Name"].lower() not in allowed
    )
    assert cuda == [], f"CUDA packages in a CPU install: {cuda}"


def test_torch_is_the_pinned_cpu_build():
    if os.environ.get("AREAL_LITE_GPU_INSTALL") == "1":
        pytest.skip("GPU install")
    import torch

    assert torch.__version__.startswith("2.13.0"), torch.__version__
    assert torch.version.cuda is None


def test_uv_gets_pips_index_settings():
    """`make` installs with uv, which reads no pip configuration: tools/uv_args.py passes pip's settings on."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "uv_args", os.path.join(os.path.dirname(__file__), "..", "tools", "uv_args.py")
    )
    uv_args = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(uv_args)
    pip_config = "\n".join(
        [
            ":env:.find-links='/opt/wheels'",
            "global.cert='/etc/ssl/certs/ca-certificates.crt'",
            "global.constraint='/etc/pip/constraints.txt'",
            "global.extra-index-url='file:///opt/a/simple file:///opt/b/simple'",
            "global.find-links='/opt/wheels'",  # the same folder again, from the file: passed once
            "install.index-url='https://mirror.example/simple'",
        ]
    )
    assert uv_args.uv_args(pip_config) == [
        "--index-strategy", "unsafe-best-match",  # pip's rule: the best version from any index
        "--find-links", "/opt/wheels",
        "--constraint", "/etc/pip/constraints.txt",
        "--extra-index-url", "file:///opt/a/simple",
        "--extra-index-url", "file:///opt/b/simple",
        "--index-url", "https://mirror.example/simple",
    ]  # fmt: skip
    assert uv_args.uv_args("") == ["--index-strategy", "unsafe-best-match"]  # no pip config: uv's defaults
