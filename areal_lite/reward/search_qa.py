"""Search-QA rewards: SQuAD-normalised F1 and exact match against one gold string or a list of them.

Design decisions: F1 comes in two flavours, "multiset" (SQuAD: Counter intersection) and "set" (ASearcher: token
sets). Both use SQuAD normalisation (lowercase, drop punctuation and a/an/the) and the HotpotQA rule that
yes/no/noanswer must match exactly. A list of golds scores the best match.
"""

from __future__ import annotations

import re
import string
from collections import Counter

__all__ = ["normalize_answer", "f1_score", "exact_match"]


# ============================================================================ QA F1 / EM
_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")


_PUNCT = set(string.punctuation)


_SPECIAL = ("yes", "no", "noanswer")


def normalize_answer(s) -> str:
    """SQuAD normalisation: lowercase, drop punctuation, drop a/an/the, collapse whitespace."""
    s = "".join(ch for ch in str(s).lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES_RE.sub(" ", s).split())


def _as_gold_list(gold) -> list[str]:
    if gold is None:
        return []
    if isinstance(gold, (list, tuple, set)):
        return [str(g) for g in gold if g is not None]
    return [str(gold)]


def _f1_single(pred: str, gold: str, mode: str) -> float:
    p_norm, g_norm = normalize_answer(pred), normalize_answer(gold)
    if (p_norm in _SPECIAL or g_norm in _SPECIAL) and p_norm != g_norm:
        return 0.0
    p_toks, g_toks = p_norm.split(), g_norm.split()
    if not p_toks or not g_toks:
        return float(p_toks == g_toks)
    if mode == "multiset":
        same = sum((Counter(p_toks) & Counter(g_toks)).values())
    else:
        p_toks, g_toks = set(p_toks), set(g_toks)
        same = len(p_toks & g_toks)
    if same == 0:
        return 0.0
    precision, recall = same / len(p_toks), same / len(g_toks)
    return 2 * precision * recall / (precision + recall)


def f1_score(pred, gold, mode: str = "multiset") -> float:
    """Token F1 of `pred` against `gold` (a str or a list: best match). mode: "multiset" | "set"."""
    if mode not in ("multiset", "set"):
        raise ValueError(f"f1 mode must be 'multiset' or 'set', got {mode!r}")
    if pred is None:
        return 0.0
    return max((_f1_single(str(pred), g, mode) for g in _as_gold_list(gold)), default=0.0)


def exact_match(pred, gold) -> float:
    """1.0 if `pred` equals `gold` (or any gold in a list) after normalisation."""
    if pred is None:
        return 0.0
    p = normalize_answer(pred)
    return max((float(p == normalize_answer(g)) for g in _as_gold_list(gold)), default=0.0)
