"""Inference engines, as AReaL 1.0.4's `areal.engine`: `sglang_remote.RemoteSGLangEngine` (the facade a trainer and
a notebook talk to: generation, episodes, pause/resume, weight updates) and `vllm_remote.RemotevLLMEngine` (the same
over vLLM's protocol, whose client is `vllm_client`). AReaL's training engines (FSDP, Megatron) have no
counterpart here: the kit's trainer is `areal_lite.trainer.ppo.actor.PPOActor`.
"""
