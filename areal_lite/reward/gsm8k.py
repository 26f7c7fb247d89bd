"""GSM8K's reward with AReaL 1.0.4's name, path and signature: `gsm8k_reward_fn(prompt, completions, prompt_ids,
completion_ids, answer, **kwargs)`, AReaL's math-verify check of the whole completion against the whole solution, so a
cell that imports it converts by its prefix and scores the same.

It pays any expression in the reply that evaluates to the answer. On GSM8K that is harmless; on questions that hold
their answer's expression ("What is 4 + 3?") it pays a reply that restates it, so the kit's arithmetic tasks use
`arithmetic.arithmetic_reward_fn` instead.
"""

from __future__ import annotations

import logging

from areal_lite.reward.math_answer import get_math_verify_worker

__all__ = ["gsm8k_reward_fn"]

logger = logging.getLogger(__name__)


def gsm8k_reward_fn(prompt, completions, prompt_ids, completion_ids, answer, **kwargs) -> float:
    """1.0 when math-verify reads the same answer from `completions` as from `answer` (e.g. '... #### 72'), else 0.0."""
    try:
        return get_math_verify_worker().verify(str(completions), str(answer))
    except Exception:  # AReaL's rule too: a reward never takes down a rollout
        logger.warning("gsm8k_reward_fn failed", exc_info=True)
        return 0.0
