"""Math answers: extract the final answer from a completion and decide whether it equals the gold.

Design decisions:
- `extract_answer` returns the raw answer *string*; `math_equal` does all normalisation. One place decides what "the
  same answer" means, and a reward never depends on how the text was cut.
- `math_equal` first compares plain numbers after normalising GSM8K-style noise (`$`, `%`, thousands commas, unit
  words, `\\text{}`, `\\frac`, `a/b`, mixed numbers, trailing periods) with a relative tolerance (integers compare
  exactly); a string that still holds exactly one number ("18 apples per day") is read as that number. Only when a
  side is not a plain number does it call `math_verify` (symbolic: `x^2+2x+1` vs `(x+1)^2`, sets, roots).
- `math_verify` times out with `signal.alarm`, which only works on the main thread. We pass its timeouts only there;
  elsewhere (threads, the engine's loop) we turn them off and rely on `AsyncRewardWrapper`, which runs rewards in
  worker processes (on their main thread, so math_verify's own timeout is back) and kills a worker that hangs.
- `answer_reward(completion, answer)` is the two-argument reward a notebook calls; `reward.gsm8k.gsm8k_reward_fn`
  wraps it in AReaL's signature.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from fractions import Fraction

from areal_lite.utils.search_tool import parse_boxed

__all__ = ["extract_answer", "math_equal", "answer_reward"]


logger = logging.getLogger(__name__)


# ============================================================================ answer extraction
_NUM = r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+"


_NUMBER_RE = re.compile(r"(?<![\w.])(?:" + _NUM + r")(?:\s*/\s*\d+(?:\.\d+)?)?")


_HASH_RE = re.compile(r"####\s*([^\n]*)")


_PHRASE_RE = re.compile(r"(?:final\s+answer|the\s+answer|answer)\s*(?:is|was|:|=)\s*:?\s*([^\n]*)", re.IGNORECASE)


def _clean_tail(s: str) -> str:
    """Drop sentence punctuation and wrapping `$`/`**` a model puts around a final answer."""
    s = s.strip()
    # "42." / "42 ." / "**42**" / "$42$": trailing period only when not part of a decimal.
    s = re.sub(r"(?<=\S)\s*[.;!?]+$", "", s)
    s = s.strip("*").strip()
    if len(s) >= 2 and s[0] == "$" and s[-1] == "$":
        s = s[1:-1].strip()
    return s


# A LaTeX fraction of numbers is one number: the last number of "$\\frac{144}{2}$" is 144/2, not 2.
_LATEX_NUMBER_FRAC_RE = re.compile(r"-?\\[dt]?frac\s*\{\s*-?[\d.,]+\s*\}\s*\{\s*-?[\d.,]+\s*\}")


def _last_number(text: str) -> str | None:
    text = text.replace("\u2212", "-")
    fracs = list(_LATEX_NUMBER_FRAC_RE.finditer(text))
    matches = list(_NUMBER_RE.finditer(text))
    if fracs and (not matches or fracs[-1].end() >= matches[-1].end()):
        return fracs[-1].group(0).replace(" ", "")
    return matches[-1].group(0).replace(" ", "") if matches else None


def extract_answer(text: str | None, mode: str = "auto") -> str | None:
    """The final answer in `text` as a string, or None.

    mode: "boxed" (last complete `\\boxed{}`/`\\fbox{}`), "hash" (GSM8K `#### N`), "phrase"
    ("the answer is X", "Final answer: X"), "last_number", or "auto" = the first of those that hits.
    """
    if not isinstance(text, str):
        return None
    if mode not in ("auto", "boxed", "hash", "phrase", "last_number"):
        raise ValueError(f"unknown extraction mode {mode!r}")
    if mode in ("auto", "boxed"):
        boxed = parse_boxed(text)
        if boxed is not None or mode == "boxed":
            return boxed
    if mode in ("auto", "hash"):
        hits = _HASH_RE.findall(text)
        if hits and hits[-1].strip():
            return _clean_tail(hits[-1])
        if mode == "hash":
            return None
    if mode in ("auto", "phrase"):
        hits = [h for h in _PHRASE_RE.findall(text) if h.strip()]
        if hits:
            return _clean_tail(hits[-1])
        if mode == "phrase":
            return None
    return _last_number(text)


# ============================================================================ math equivalence
_UNIT_WORDS = (
    "dollars|dollar|usd|cents|cent|euros|euro|pounds|pound|lbs|lb|ounces|ounce|oz|"
    "percent|per\\s*cent|"
    "kilometers|kilometres|km|meters|metres|meter|metre|centimeters|centimetres|cm|millimeters|mm|m|"
    "miles|mile|mph|feet|foot|ft|inches|inch|in|yards|yard|yd|"
    "kilograms|kg|grams|gram|g|liters|litres|liter|litre|ml|l|gallons|gallon|"
    "hours|hour|hrs|hr|h|minutes|minute|mins|min|seconds|second|secs|sec|s|"
    "days|day|weeks|week|months|month|years|year|degrees|degree|units|unit|points|point"
)


# Units only count right after a number ("5 cm", "20 square meters"), so words in symbolic answers stay.
_UNIT_RE = re.compile(r"(?i)(\d)\s*(?:square\s+|sq\.?\s*|cubic\s+)?(?:" + _UNIT_WORDS + r")\b(?:\^\{?[23]\}?|²|³)?")


_LATEX_WRAP_RE = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")


_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{\s*(-?[\d.]+)\s*\}\s*\{\s*(-?[\d.]+)\s*\}")


_FRAC_SHORT_RE = re.compile(r"\\[dt]?frac\s*(\d)\s*(\d)")


_THOUSANDS_RE = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


_PLAIN_NUMBER_RE = re.compile(r"^[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:e[-+]?\d+)?$", re.IGNORECASE)


def _normalize_math(s: str) -> tuple[str, bool]:
    """Strip formatting noise; returns (text, had_percent)."""
    s = str(s).strip().replace("\u2212", "-").replace("\u00a0", " ")
    s = _LATEX_WRAP_RE.sub(r" \1 ", s)
    s = s.replace("\\$", "$").replace("\\%", "%").replace("\\!", "").replace("\\,", "").replace("\\;", "")
    s = s.replace("\\left", "").replace("\\right", "").replace("~", " ")
    s = re.sub(r"^\s*(?:[a-zA-Z]\s*=|=)\s*", "", s)  # "x = 5" / "= 5"
    s = _FRAC_RE.sub(r"\1/\2", s)
    s = _FRAC_SHORT_RE.sub(r"\1/\2", s)
    s = _THOUSANDS_RE.sub("", s)
    had_percent = "%" in s or re.search(r"(?i)\bper\s*cent\b|\bpercent\b", s) is not None
    s = s.replace("%", " ").replace("$", " ")
    s = _UNIT_RE.sub(r"\1 ", s)
    s = _clean_tail(s)
    s = re.sub(r"\s+", " ", s).strip()
    return s, had_percent


def _parse_number(s: str) -> Fraction | None:
    """A plain number, `a/b`, or a mixed number `a b/c`; None otherwise."""
    s = s.replace(" ", "") if re.fullmatch(r"-?[\d.]+\s*/\s*-?[\d.]+", s) else s
    try:
        if _PLAIN_NUMBER_RE.match(s):
            return Fraction(s)
        m = re.fullmatch(r"(-?[\d.]+)/(-?[\d.]+)", s)
        if m:
            den = Fraction(m.group(2))
            return Fraction(m.group(1)) / den if den != 0 else None
        m = re.fullmatch(r"(-?)(\d+) (\d+)/(\d+)", s)
        if m and int(m.group(4)) != 0:
            value = int(m.group(2)) + Fraction(int(m.group(3)), int(m.group(4)))
            return -value if m.group(1) else value
    except (ValueError, ZeroDivisionError, OverflowError):
        return None
    return None


def _to_number(s) -> tuple[Fraction | None, bool]:
    """Numeric value of an answer string after normalisation, and whether it carried a percent."""
    text, had_percent = _normalize_math(s)
    value = _parse_number(text)
    if value is None:
        # "18 apples per day" → 18: a lone number in leftover words is the answer; two numbers
        # ("3 + 4", "2 hours 30 minutes") are not, and go to the symbolic checker instead.
        nums = _NUMBER_RE.findall(text)
        letters_only = re.sub(_NUMBER_RE, " ", text)
        if len(nums) == 1 and not re.search(r"[\\^_{}()\[\]=+*<>|]", letters_only):
            value = _parse_number(nums[0].replace(" ", ""))
    return value, had_percent


def _close(a: Fraction, b: Fraction, rel_tol: float) -> bool:
    if a == b:
        return True
    if a.denominator == 1 and b.denominator == 1:
        return False  # two different integers are different answers, however large (100000 vs 100001)
    return math.isclose(float(a), float(b), rel_tol=rel_tol, abs_tol=1e-9)


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class _DropTimeoutWarning(logging.Filter):
    # math_verify warns once per process when its signal timeout is off; off-main-thread that is
    # our deliberate choice (the process pool provides the timeout), so the warning is noise.
    def filter(self, record):
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutWarning())


_MAX_SYMBOLIC_CHARS = 1000


def _verify_symbolic(pred: str, gold: str, timeout_s: int = 5) -> bool:
    from math_verify import parse, verify

    t = timeout_s if _on_main_thread() else None

    def _parse(s):
        # An extracted answer is one expression: read it as LaTeX math first. Bare, math_verify
        # would misread "(x+1)^2" (nothing) or "2^{10}" (just "2").
        got = parse(f"${s}$", parsing_timeout=t) if "$" not in s and "\\boxed" not in s else []
        return got or parse(s, parsing_timeout=t)

    gold_p, pred_p = _parse(gold), _parse(pred)
    if not gold_p or not pred_p:
        return False
    return bool(verify(gold_p, pred_p, timeout_seconds=t))


def math_equal(pred, gold, rel_tol: float = 1e-4) -> bool:
    """Whether `pred` and `gold` are the same mathematical answer. Never raises."""
    try:
        if pred is None or gold is None:
            return False
        pred, gold = str(pred).strip(), str(gold).strip()
        if not pred or not gold or pred.lower() in ("none", "null"):
            return False
        p_num, p_pct = _to_number(pred)
        g_num, g_pct = _to_number(gold)
        if p_num is not None and g_num is not None:
            if _close(p_num, g_num, rel_tol):
                return True
            # "50%" vs "0.5": accept the percent reading of either side.
            if p_pct != g_pct:
                scaled = (p_num / 100, g_num) if p_pct else (p_num, g_num / 100)
                return _close(*scaled, rel_tol)
            return False
        if _normalize_math(pred)[0].lower() == _normalize_math(gold)[0].lower():
            return True
        if max(len(pred), len(gold)) > _MAX_SYMBOLIC_CHARS:
            return False  # not a final answer; sympy could spend seconds on it
        return _verify_symbolic(pred, gold)
    except Exception:  # a reward must not take down a rollout
        logger.debug("math_equal(%r, %r) failed", pred, gold, exc_info=True)
        return False


def _gold_from_solution(answer) -> str | None:
    """GSM8K solutions end in '#### N'; reasoning-gym and plain datasets give N itself."""
    if answer is None:
        return None
    text = str(answer).strip()
    if _to_number(text)[0] is not None:
        return text
    return extract_answer(text, "hash") or extract_answer(text, "last_number")


def answer_reward(completion, answer, **kwargs) -> float:
    """1.0 if the completion's final answer (boxed → #### → 'the answer is' → last number) equals the gold."""
    try:
        gold = _gold_from_solution(answer)
        pred = extract_answer(completion, "auto")
        return 1.0 if gold is not None and math_equal(pred, gold) else 0.0
    except Exception:
        logger.debug("answer_reward failed", exc_info=True)
        return 0.0
