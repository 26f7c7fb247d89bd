"""A small SGLang-compatible generation server: continuous batching with a KV cache, on CPU or one GPU.

    python -m areal_lite.kit.serve --model-path PATH_OR_ALIAS [--host 127.0.0.1] [--port 30000] [--threads 1]

It speaks the subset of SGLang 0.5.23's native HTTP API that RL rollout needs, with its request and response shapes
(`/generate`, `/health`, `/model_info`, `/server_info`, `/pause_generation`, `/continue_generation`, `/abort_request`,
`/update_weights_from_disk`, `/load_lora_adapter`, `/unload_lora_adapter`, `/flush_cache`: `app.ROUTES`), so the
same client code (`RemoteSGLangEngine`) talks to either server. No prefix cache across requests: `cached_tokens` is
always 0 and `/flush_cache` has nothing to drop.

The package, from the wire inwards:
- `app`: the aiohttp routes. Thin handlers on the event loop: read, validate, hand to the scheduler, answer.
- `protocol`: SGLang's bodies as pure functions (strict validation, SGLang's defaults, the response dict), and
  `GenerationState`, one row being generated.
- `scheduler`: the `Scheduler`, one thread that owns the model and runs continuous batching.
- `batch`: `RunningBatch` (the rows decoding together over one KV cache) and `HFRunner` (the model's own forward).
- `fastpath`: `FastRunner`, a functional forward for Llama/Qwen2-family models over an in-place KV cache.
- `sampling`: next-token sampling, logprobs and finish rules, matching SGLang's numbers.
- `lora`: one LoRA adapter at a time, merged into the weights. `weights`: loading the model and updates from disk.
- `cli`: the process: a command line built from `EmbeddedServerConfig`, bind, load, serve until SIGTERM.
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
