"""The model a benchmark runs: `tiny` (a 256x4 random Qwen2, built once into the temp dir) or a packaged/local one.

The tiny model is bigger than the tests' (hidden 256, 4 layers) so that timings measure the model, not Python
overhead, and it needs no conversion, so a benchmark starts in seconds on a fresh machine.
"""

from __future__ import annotations

import os
import tempfile


def bench_model_path(name: str) -> str:
    if name != "tiny":
        from areal_lite.utils.model_store import resolve_model_path

        return resolve_model_path(name)
    from areal_lite.utils.model_store import build_tiny_model

    folder = os.path.join(tempfile.gettempdir(), "areal-lite-bench", "tiny-256x4")
    return build_tiny_model(folder, seed=0, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2)
