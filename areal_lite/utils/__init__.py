"""Helpers shared by the trainer and the workflows, as AReaL 1.0.4's `areal.utils`: `functional` holds the PPO/GRPO
maths on tensors (advantages, KL, the clipped token loss), as AReaL's `areal.utils.functional`.
"""
