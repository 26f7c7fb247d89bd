"""`RemotevLLMEngine` (AReaL 1.0.4's `areal.engine.vllm_remote`): `RemoteSGLangEngine` over vLLM's wire protocol.

The facade, executor and staleness bound are `areal_lite.engine.sglang_remote`'s; only the client differs
(`areal_lite.engine.vllm_client.VLLMClient`).
"""

from __future__ import annotations

from areal_lite.engine.sglang_remote import RemoteSGLangEngine
from areal_lite.engine.vllm_client import VLLMClient

__all__ = ["RemotevLLMEngine"]


class RemotevLLMEngine(RemoteSGLangEngine):
    """`RemoteSGLangEngine` for vLLM servers (AReaL 1.0.4's name): the same methods, arguments and behaviour over
    vLLM's protocol (`areal_lite.engine.vllm_client`). Start the server with `launch_server(config, backend="vllm")`.

    Logprobs are taken after temperature, as SGLang's (the launcher passes `--logprobs-mode processed_logprobs`);
    disk weight updates reload every layer, a tied output layer included, and reset the prefix cache; NCCL weight
    updates are not implemented. `initialize` refuses a server that is not vLLM."""

    _CLIENT = VLLMClient
