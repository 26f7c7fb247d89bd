"""GSM8K's reward with AReaL 1.0.4's name, path and signature: `gsm8k_reward_fn(prompt, completions, prompt_ids,
completion_ids, answer, **kwargs)`, so a cell that imports it converts by its prefix.
"""

from __future__ import annotations

from areal_lite.reward.math_answer import answer_reward

__all__ = ["gsm8k_reward_fn"]


def gsm8k_reward_fn(prompt, completions, prompt_ids, completion_ids, answer, **kwargs) -> float:
    """`answer_reward` with AReaL's reward signature (prompt, completions, prompt_ids, completion_ids, answer)."""
    return answer_reward(completions, answer)
