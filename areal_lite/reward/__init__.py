"""Rewards, as AReaL 1.0.4's `areal.reward`: the same exports (`MathVerifyWorker`, `get_math_verify_worker`,
`gsm8k_reward_fn`, `geometry3k_reward_fn`, `clevr_count_70k_reward_fn`) at the same module paths, with AReaL's
signatures and scores. Kit modules beside them: `math_answer` (the math-verify worker, plus `extract_answer`,
`math_equal` and the two-argument `answer_reward` a notebook calls), `arithmetic` (the final answer only: the demo's
reward), `search_qa` (F1 / exact match) and `judge` (a judge model that ranks a GRPO group's answers, notebook 12).

Design decision: rewards never raise. Malformed input scores 0.0; a reward that crashes is a bug to log, not a
reason to lose a rollout batch. They run in worker processes through `areal_lite.api.reward_api.AsyncRewardWrapper`.
Importing this package is cheap: math-verify (and sympy) load on the first check.
"""

from areal_lite.reward.clevr_count_70k import clevr_count_70k_reward_fn
from areal_lite.reward.geometry3k import geometry3k_reward_fn
from areal_lite.reward.gsm8k import gsm8k_reward_fn
from areal_lite.reward.math_answer import MathVerifyWorker, get_math_verify_worker

__all__ = [
    "MathVerifyWorker",
    "get_math_verify_worker",
    "gsm8k_reward_fn",
    "geometry3k_reward_fn",
    "clevr_count_70k_reward_fn",
]
