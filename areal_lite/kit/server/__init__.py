"""The inference server side: the embedded SGLang-compatible server, vLLM's worker extension, and their launcher.

    python -m areal_lite.kit.server --model-path PATH_OR_ALIAS [--host 127.0.0.1] [--port 30000] [--threads 1]

The embedded server speaks the subset of SGLang 0.5.23's native HTTP API that RL rollout needs (`app.ROUTES`), with
its request and response shapes, so one client (`RemoteSGLangEngine`) talks to it, to SGLang and to vLLM (with
`vllm_ext`). It is a leaf process: it imports nothing of the trainer or the client (tests/test_package.py).

- `launch`: `launch_server`, one server in a child process from a config; `procs`: children that never outlive it;
- `app`: the aiohttp routes, thin handlers on the event loop; `cli`: the process, bind, load, serve until SIGTERM;
- `protocol`: SGLang's bodies as pure functions (strict validation, SGLang's defaults), and `GenerationState`;
- `scheduler`: one thread that owns the model and runs continuous batching over `batch.RunningBatch`'s KV cache;
- `fastpath`: a functional forward for Llama/Qwen2-family models; `sampling`: SGLang's sampling and logprobs;
- `lora`: one LoRA adapter at a time, merged; `weights`: loading the model, updates, what is served;
- `lean`: a Llama/Qwen2 checkpoint loaded without transformers for the fast path (a server starts seconds sooner);
- `precision`: what `--dtype auto` serves on this machine (bf16 only where measured faster and batch-exact);
- `vllm_ext/`: the worker extension a vLLM server loads to take the kit's weight updates.
Names are exported lazily: launching a server from a notebook does not load the server's own modules.
"""

from areal_lite.utils.lazy import lazy_exports

_LAZY_IMPORTS = {
    "BadRequest": "areal_lite.utils.jsonhttp",
    "ServerState": "areal_lite.kit.server.app",
    "build_app": "areal_lite.kit.server.app",
    "RunningBatch": "areal_lite.kit.server.batch",
    "build_parser": "areal_lite.kit.server.cli",
    "main": "areal_lite.kit.server.cli",
    "parse_args": "areal_lite.kit.server.cli",
    "GenerationState": "areal_lite.kit.server.protocol",
    "PromptSpec": "areal_lite.kit.server.protocol",
    "SamplingParams": "areal_lite.kit.server.protocol",
    "parse_generate_body": "areal_lite.kit.server.protocol",
    "parse_sampling_params": "areal_lite.kit.server.protocol",
    "render_generate_response": "areal_lite.kit.server.protocol",
    "sample_tokens": "areal_lite.kit.server.sampling",
    "Scheduler": "areal_lite.kit.server.scheduler",
    "eos_ids": "areal_lite.kit.server.weights",
}

__all__ = sorted(_LAZY_IMPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY_IMPORTS)
