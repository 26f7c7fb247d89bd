"""The trainer's helpers, beside `engine/fsdp_engine.py` as AReaL 1.0.4's `areal.engine.fsdp_utils`:
`packing` (rows packed into one sequence, micro-batches, AReaL's list-of-trajectories batches), `weights` (full
state dicts, HF folders for the server, NCCL weight broadcast, checkpoints), `lora` (peft wrapping, adapter files),
`embedding_grad` (the embedding's gradient row by row) and `cpu_linear` (the LM head's forward on the faster
CPU kernel).
"""
