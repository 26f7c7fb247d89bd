"""A small SGLang-compatible generation server: continuous batching with a KV cache, on CPU or one GPU.

    python -m areal_lite.kit.serve --model-path PATH_OR_ALIAS [--host 127.0.0.1] [--port 30000] [--threads 1]

It speaks the subset of SGLang's native HTTP API that RL rollout needs (`/generate`, `/health`, `/model_info`,
`/pause_generation`, `/continue_generation`, `/abort_request`, `/update_weights_from_disk`, `/flush_cache`), with
SGLang 0.5.23's request and response shapes, so the same client code (`RemoteSGLangEngine`) talks to either server.

The package, from the wire inwards:
- `app`: the aiohttp routes. Thin handlers on the event loop: read, validate, hand to the scheduler, answer.
- `protocol`: SGLang's bodies as pure functions (strict validation, SGLang's defaults, the response dict).
- `scheduler`: the `Scheduler`, one thread that owns the model and runs continuous batching; pause, abort and
  weight updates are commands it handles between model steps, so model state needs no locks.
- `batch`: `GenerationState` (one row being generated), `RunningBatch` (the rows decoding together over one
  KV cache) and the runner that computes them with the model's own forward (`HFRunner`).
- `fastpath`: `FastRunner`, the runner for Llama/Qwen2-family models: a functional forward with fused projections
  over a preallocated, in-place KV cache (`StaticKV`); the same numbers, with no per-step copy of the cache.
- `sampling`: next-token sampling, logprobs and finish rules, matching SGLang's numbers.
- `weights`: loading the model at startup and from a safetensors folder on update.
- `cli`: the process: a command line built from `EmbeddedServerConfig`, bind, load, serve until SIGTERM.

No prefix cache: `cached_tokens` is always 0 and `/flush_cache` has nothing to drop.
"""

from areal_lite.kit.serve.app import ServerState, build_app
from areal_lite.kit.serve.batch import RunningBatch
from areal_lite.kit.serve.cli import build_parser, main, parse_args
from areal_lite.kit.serve.protocol import (
    GenerationState,
    PromptSpec,
    SamplingParams,
    parse_generate_body,
    parse_sampling_params,
    render_generate_response,
)
from areal_lite.kit.serve.sampling import sample_tokens
from areal_lite.kit.serve.scheduler import Scheduler
from areal_lite.kit.serve.weights import eos_ids
from areal_lite.utils.jsonhttp import BadRequest

__all__ = [
    "BadRequest",
    "GenerationState",
    "PromptSpec",
    "RunningBatch",
    "SamplingParams",
    "Scheduler",
    "ServerState",
    "build_app",
    "build_parser",
    "eos_ids",
    "main",
    "parse_args",
    "parse_generate_body",
    "parse_sampling_params",
    "render_generate_response",
    "sample_tokens",
]
