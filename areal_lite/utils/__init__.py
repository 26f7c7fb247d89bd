"""Helpers shared by the trainer, the workflows and the servers, as AReaL 1.0.4's `areal.utils`.

At AReaL's paths: `functional` (the PPO/GRPO losses, rejection sampling, returns), `data` (normalisation, padding,
packing and micro-batches, `concat_padded_tensors`, `cycle_dataloader`), `dataloader` and `hf_utils`. The kit's own:
`trajectory` (the tensor contract and its checker), `model_store` and `device` (offline models, devices, threads),
`search_tool` (search tags and the retrieval call), `atomic` (files and folders swapped into place whole), `jsonhttp`
(the servers' JSON error contract), `lazy` (package re-exports loaded on first use), `machine` (CPU model, cores,
vector ISA), `prefix` (the prompts' shared start), `safetensors_io` (the weight sync's file writer), `weight_dirs`,
`flock` and `lifeline` (what a run owns, and its clean-up when a process dies) and `network` (free ports).
"""
