#!/usr/bin/env bash
# `make trl`: TRL's own virtual environment, .venv-trl, for `bench/vs_trl.py` (the kit against TRL's GRPOTrainer).
#
# TRL runs from its own interpreter, as vLLM does (`make vllm`): it brings its own transformers, accelerate and
# datasets, and the kit's .venv must not follow them. torch is the kit's pin, 2.13.0, installed first and kept
# pinned in the second call, so both sides train with the same torch build. Without CUDA that must be the CPU wheel:
# PyPI's Linux torch pulls gigabytes of CUDA libraries. As in `make install`, `tools/uv_args.py --cpu-torch pip`
# asks pip's dry run which wheels the pin brings; where they include CUDA libraries the script adds PyTorch's CPU index.
# Besides TRL: math-verify and aiohttp, what the kit's reward module (`areal_lite.reward.gsm8k`) imports, so the TRL
# process scores with the kit's own reward function (the checkout on its PYTHONPATH, nothing else of the kit).
# No vLLM here: TRL generates with transformers' `generate` (use_vllm=False).
#
# Environment: PY (the python that makes the venv, default python3), TRL_VENV (default .venv-trl).
set -euo pipefail

PY=${PY:-python3}
VENV=${TRL_VENV:-.venv-trl}
TRL_PIN="trl==1.16.0"
TORCH_PIN="torch==2.13.0"
# The kit's reward imports these (pyproject.toml's ranges).
REWARD_DEPS=("math-verify>=0.7" "aiohttp>=3.9")

start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip

TORCH_FROM=()
if ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; }; then
    read -r -a TORCH_FROM <<< "$("$VENV/bin/python" tools/uv_args.py --cpu-torch pip "$TORCH_PIN")"
    if [ ${#TORCH_FROM[@]} -gt 0 ]; then
        echo "make trl: pip's $TORCH_PIN would bring CUDA libraries: adding ${TORCH_FROM[*]}"
    fi
fi
echo "make trl: installing $TORCH_PIN, then $TRL_PIN (torch kept pinned)"
"${PIP[@]}" install -q ${TORCH_FROM[@]+"${TORCH_FROM[@]}"} "$TORCH_PIN"
"${PIP[@]}" install -q ${TORCH_FROM[@]+"${TORCH_FROM[@]}"} "$TRL_PIN" "$TORCH_PIN" "${REWARD_DEPS[@]}"

"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md

import torch
import trl
from trl import GRPOConfig, GRPOTrainer  # noqa: F401

names = ("trl", "torch", "transformers", "accelerate", "datasets", "math-verify", "aiohttp")
print("make trl:", ", ".join(f"{n} {md.version(n)}" for n in names))
if not torch.cuda.is_available() and torch.version.cuda is not None:
    raise SystemExit(f"make trl: torch {torch.__version__} is a CUDA build on a machine without CUDA")
EOF
touch "$VENV/.installed"
echo "make trl: $VENV ready in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1) on disk"
