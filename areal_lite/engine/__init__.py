"""Engines, as AReaL 1.0.4's `areal.engine`.

- Inference: `sglang_remote.RemoteSGLangEngine` (the facade a trainer and a notebook talk to: generation, episodes,
  pause/resume, weight updates) and `vllm_remote.RemotevLLMEngine` (the same over vLLM's protocol, whose client is
  `vllm_client`).
- Training: `fsdp_engine.FSDPPPOActor`, the decoupled-PPO actor with AReaL's methods and call order (one process
  on the CPU or a GPU, or FSDP2 under torchrun), with its helpers in `fsdp_utils/`. AReaL's Megatron engine has no
  counterpart.
"""
