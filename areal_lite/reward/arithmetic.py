"""The reward of the kit's arithmetic tasks (`areal_lite.dataset.arithmetic`), in AReaL's reward signature.

AReaL's `gsm8k_reward_fn` reads any expression in the reply that evaluates to the answer, so on "What is 4 + 3?" the
reply "To find 4 + 3, add them." scores 1.0: a small model learns to restate the question. Here only the reply's
final answer counts (boxed, `#### N`, "the answer is N", else the last number): `math_answer.answer_reward`.
"""

from __future__ import annotations

from areal_lite.reward.math_answer import answer_reward

__all__ = ["arithmetic_reward_fn"]


def arithmetic_reward_fn(prompt, completions, prompt_ids, completion_ids, answer, **kwargs) -> float:
    """1.0 when the final answer of `completions` equals the gold's ('4 + 3 = 7\\n#### 7' or '7'), else 0.0."""
    return answer_reward(completions, answer)
