"""CLEVR-Count-70K's reward with AReaL 1.0.4's names, path and signatures: the completion's last bracketed number
(`[3]`) must equal the answer string exactly (both stripped).

Unlike AReaL's, it never raises: a completion that is not a string, or an answer that is neither None nor a string,
scores 0.0 (AReaL raises TypeError / AttributeError), as the kit's other rewards do.
"""

from __future__ import annotations

import logging
import re

__all__ = ["extract_answer", "clevr_count_70k_reward_fn"]

logger = logging.getLogger(__name__)

_BRACKETED_NUMBER_RE = re.compile(r"\[([0-9.]+)\]")


def extract_answer(pred_str: str, data_name: str, use_last_number: bool = True) -> str:
    """The last `[N]` in `pred_str` (digits and dots), or "". `data_name` and `use_last_number` are accepted as in
    AReaL and change nothing."""
    found = _BRACKETED_NUMBER_RE.findall(pred_str)
    return found[-1] if found else ""


def clevr_count_70k_reward_fn(prompt, completions, prompt_ids, completion_ids, answer, **kwargs) -> float:
    """1.0 when the completion's `[N]` is the answer, character for character (stripped), else 0.0."""
    if answer is None:
        return 0.0
    try:
        correct = extract_answer(completions, data_name="").strip() == answer.strip()
    except Exception:  # AReaL raises here (a completion or answer that is not a string); a reward must not
        logger.warning("clevr_count_70k_reward_fn failed", exc_info=True)
        return 0.0
    return float(correct)
