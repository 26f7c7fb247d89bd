"""The kit's own parts: what AReaL 1.0.4 does not have, kept together in one package.

- `serve/`: the embedded SGLang-compatible inference server (`python -m areal_lite.kit.serve`), and `vllm_ext/`, the
  worker extension the vLLM server loads;
- `rag`: the local retrieval server (ASearcher's API);
- `launch`, `procs`: starting servers from a notebook, and child processes that never outlive it;
- `plot`: the notebooks' plots; `viewer`: the trajectory viewer; `checks`: the notebooks' exercise checks;
- `train`: the GRPO loop as one script (`python -m areal_lite.kit.train`);
- `areal_compat`, `areal_config`: the bridge to AReaL (which names move, cell conversion, export; kit YAML -> AReaL
  YAML);
- `prepare`: model and data prepared once for offline use (`python -m areal_lite.kit.prepare`);
- `demo`: the CPU GRPO demo behind `make demo` (`python -m areal_lite.kit.demo`).

The AReaL-shaped modules (configs, records, engines, workflows, rewards, ...) live outside this package and never
import it. Every public name here is still importable from `areal_lite` itself. Importing this package loads
nothing (no torch).
"""
