"""Code that runs inside the vLLM server process (`backend=vllm`), not in the kit's own interpreter.

vLLM runs from its own virtual environment (`.venv-vllm`, made by `make vllm`), which does not have the kit
installed. The launcher puts this folder on that process's PYTHONPATH, so each module here is imported there as a
top-level module (`areal_lite_vllm_worker`) and must import nothing from `areal_lite`. Only this folder goes on the
path, not the package's: the kit's module names (`config`, `data`, `tools`, ...) would shadow other packages there.
"""
