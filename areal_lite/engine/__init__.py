"""Engines, as AReaL 1.0.4's `areal.engine`.

- Inference: `sglang_remote.RemoteSGLangEngine` (the facade a trainer and a notebook talk to: generation, episodes,
  pause/resume, weight updates) and `vllm_remote.RemotevLLMEngine` (the same over vLLM's protocol, whose client is
  `vllm_client`).
- Training: `fsdp_engine.FSDPPPOActor`, the decoupled-PPO actor with AReaL's methods and call order (one process
  on the CPU or a GPU, or FSDP2 under torchrun), with its helpers in `fsdp_utils/`. AReaL's Megatron engine has no
  counterpart.
"""

from areal_lite.utils.lazy import lazy_exports

# AReaL's `areal.engine` re-exports its engines lazily; these are the ones the kit has.
_LAZY_IMPORTS = {
    "FSDPPPOActor": "areal_lite.engine.fsdp_engine",
    "RemoteSGLangEngine": "areal_lite.engine.sglang_remote",
    "RemotevLLMEngine": "areal_lite.engine.vllm_remote",
}

__all__ = sorted(_LAZY_IMPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY_IMPORTS)
