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
