"""Geometry3K's reward with AReaL 1.0.4's names, path and signatures: `geometry3k_reward_fn(prompt, completions,
prompt_ids, completion_ids, answer, **kwargs)` reads the last `[...]` of each text (Geometry3K's answer format; else
its last number) and compares the two with AReaL's math-verify check (`math_answer.MathVerifyWorker`).
"""

from __future__ import annotations

import logging
import re

from areal_lite.reward.math_answer import get_math_verify_worker

__all__ = ["extract_answer", "geometry3k_reward_fn"]

logger = logging.getLogger(__name__)

_BRACKETED_RE = re.compile(r"\[([^\]]+)\]")
_NUMBER_RE = re.compile(r"-?\d*\.?\d+")


def extract_answer(pred_str: str, use_last_number: bool = True) -> str:
    """The content of the last `[...]` in `pred_str`; else (`use_last_number`) its last number, commas dropped; else
    ""."""
    bracketed = _BRACKETED_RE.findall(pred_str)
    if bracketed:
        return bracketed[-1]
    numbers = _NUMBER_RE.findall(pred_str.replace(",", "")) if use_last_number else []
    return numbers[-1] if numbers else ""


def geometry3k_reward_fn(prompt, completions, prompt_ids, completion_ids, answer, **kwargs) -> float:
    """1.0 when the completion's answer equals the gold's (math-verify), else 0.0; a gold without brackets or numbers
    is compared whole. Never raises."""
    try:
        pred = extract_answer(str(completions))
        gold = extract_answer(str(answer)) or str(answer)
        if not pred or not gold:
            return 0.0
        return get_math_verify_worker().verify(pred, gold)
    except Exception:
        logger.warning("geometry3k_reward_fn failed", exc_info=True)
        return 0.0
