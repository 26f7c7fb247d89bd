"""The kit's own parts: what AReaL 1.0.4 does not have, in rooms named for their job.

- `server/`: the embedded SGLang-compatible inference server (`python -m areal_lite.kit.server`), vLLM's worker
  extension, and `launch_server` with the child processes it starts;
- `trainer/`: the GRPO loop as one script (`python -m areal_lite.kit.trainer.train`), run folders, the demo;
- `rag/`: the local retrieval server (ASearcher's API): corpus, index and retrievers, HTTP server, launcher;
- `notebook/`: offline preparation, plots, the trajectory viewer, exercise checks, the overlap report;
- `areal/`: the bridge to AReaL (which names move, cell conversion, config export, AReaL's trainer on the export).

The AReaL-shaped modules (configs, records, engines, workflows, rewards, ...) live outside this package and never
import it. The names the notebooks use are importable from `areal_lite` itself. Importing this package loads
nothing (no torch).
"""
