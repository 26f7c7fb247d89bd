"""Rewards, as AReaL 1.0.4's `areal.reward`: `gsm8k.gsm8k_reward_fn` has AReaL's name, path and signature;
`math_answer` (answer extraction, math equivalence, `answer_reward(completion, answer)`) and `search_qa` (F1 / exact
match) are the pieces a notebook calls directly.

Design decision: rewards never raise. Malformed input scores 0.0; a reward that crashes is a bug to log, not a
reason to lose a rollout batch. They run in worker processes through `areal_lite.api.reward_api.AsyncRewardWrapper`.
"""
