"""Math answers: AReaL's math-verify check, and the kit's helpers that read and compare one final answer.

- `MathVerifyWorker` / `get_math_verify_worker()` (AReaL 1.0.4's `areal.reward` names) score a whole completion
  against a whole gold text the way AReaL does: math-verify reads the answer out of each text (`\\boxed{}`, "final
  answer is", "answer:", else the last number, expression or LaTeX) and compares values symbolically, floats
  rounded to `precision` decimals. `gsm8k_reward_fn` is that check in AReaL's reward signature,
  `geometry3k_reward_fn` feeds it bracketed answers.
- Speed (a group of samples shares its gold): parsed golds are cached, and a text that is just an integer ("72") is
  read as the integer math-verify would read, without sympy's string parser. Scores stay AReaL's.
- Timeouts: math-verify's own timeouts use `signal.alarm`, which fails off the main thread, so they are off; the
  check runs on a reusable daemon thread and scores 0.0 when it overruns `timeout`, from any thread or process
  (`AsyncRewardWrapper` workers included).
- `extract_answer` and `math_equal` are the kit's tools for one answer string: the extracted answer a student can
  print (boxed, `#### N`, "the answer is", last number) and a tolerant numeric comparison (units, `%`, thousands
  commas, fractions); what is not a plain number goes to the same math-verify worker. `answer_reward` compares the
  final answers only: the check for questions that contain their own answer's expression ("What is 4 + 3?").
- Nothing here raises on any input: a malformed completion scores 0.0 and is logged.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import math
import os
import queue
import re
import threading
import weakref
from fractions import Fraction
from typing import Any, Callable

from areal_lite.utils.search_tool import parse_boxed

__all__ = ["MathVerifyWorker", "get_math_verify_worker", "extract_answer", "math_equal", "answer_reward"]


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


# Dataset names older AReaL code passes as `extract_answer(text, data_name, use_last_number)`: all mean "auto".
_DATASET_NAMES = frozenset({"math", "gsm8k", "gsm_hard", "svamp", "asdiv", "mawps", "math500", "aime24", "amc23"})


def extract_answer(text: str | None, mode: str = "auto", use_last_number: bool = True) -> str | None:
    """The final answer in `text` as a string, or None.

    mode: "boxed" (last complete `\\boxed{}`/`\\fbox{}`), "hash" (GSM8K `#### N`), "phrase"
    ("the answer is X", "Final answer: X"), "last_number", or "auto" = the first of those that hits; a dataset name
    ("math", "gsm8k", ...) means "auto". `use_last_number=False` drops auto's last-number fallback.
    """
    if not isinstance(text, str):
        return None
    if mode in _DATASET_NAMES:
        mode = "auto"
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
    return _last_number(text) if use_last_number or mode == "last_number" else None


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
            exponent = re.search(r"e[-+]?0*(\d+)$", s, re.IGNORECASE)
            if exponent and (len(exponent.group(1)) > 4 or int(exponent.group(1)) > 1000):  # 1e3000000: no answer,
                return None  # and Fraction alone takes seconds on it
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


# ============================================================================ math-verify (AReaL's check)
class _DropTimeoutWarning(logging.Filter):
    # math_verify warns once per process that its signal timeouts are off; that is deliberate here (the
    # thread deadline below replaces them), so the warning is noise.
    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutWarning())


def _serve(jobs: queue.SimpleQueue) -> None:
    while (job := jobs.get()) is not None:
        fn, args, future = job
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # handed to the caller, which decides
            future.set_exception(exc)


class _Runner:
    """A daemon thread that runs its calling thread's checks one at a time. A check that overruns its deadline is
    left behind with its thread (a daemon cannot hold up the interpreter's exit) and the next call starts a new one;
    the thread also ends when its calling thread does (the thread-local runner is dropped), so none pile up.
    """

    def __init__(self) -> None:
        self.pid = os.getpid()  # a forked child has the object but not the thread
        self.abandoned = False
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=_serve, args=(self._jobs,), name="math-verify", daemon=True).start()
        weakref.finalize(self, self._jobs.put, None)

    def run(self, fn: Callable[..., Any], args: tuple, timeout: float) -> Any:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fn, args, future))
        try:
            return future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            self.abandoned = True
            self._jobs.put(None)  # the thread ends once the overrunning check returns
            raise


_runners = threading.local()


def _call_with_timeout(fn: Callable[..., Any], args: tuple, timeout: float | None) -> Any:
    """fn(*args), raising concurrent.futures.TimeoutError after `timeout` seconds (None: no limit), from any thread."""
    if timeout is None:
        return fn(*args)
    runner = getattr(_runners, "runner", None)
    if runner is None or runner.abandoned or runner.pid != os.getpid():
        runner = _runners.runner = _Runner()
    return runner.run(fn, args, timeout)


# A whole text that is a canonical integer. math-verify reads it as that integer (its anchor-less number pattern,
# leading zeros and "-0" aside, which are left to it), only more slowly: sympy parses the digits as an expression.
_PLAIN_INT_RE = re.compile(r"0|-?[1-9][0-9]{0,29}")


# Texts longer than this are parsed without caching: a cache of long completions would be memory, not speed.
_CACHE_MAX_CHARS = 2000


@functools.lru_cache(maxsize=2048)
def _parse_cached(text: str, targets: tuple) -> tuple:
    from math_verify.parser import parse

    return tuple(parse(text, extraction_config=targets, parsing_timeout=None))


class MathVerifyWorker:
    """AReaL 1.0.4's `areal.reward.MathVerifyWorker`: `verify(response, ground_truth)` is 1.0 when math-verify reads
    equal answers from both texts, else 0.0 (also on a parse failure, an error, or a check over `timeout` seconds).

    try_extract_without_anchor: also read unanchored numbers/expressions (else only "answer: 1", "final answer is 1",
    `\\boxed{}`); precision: decimals floats are rounded to before comparing; timeout: seconds for one whole check,
    None for no limit. Works from any thread.
    """

    def __init__(self, try_extract_without_anchor: bool = True, precision: int = 6, timeout: float | None = 5.0):
        from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig

        targets = (ExprExtractionConfig(try_extract_without_anchor=try_extract_without_anchor), LatexExtractionConfig())
        self.gold_extraction_target = targets
        self.pred_extraction_target = targets
        self.precision = precision
        self.timeout = timeout
        # The integer shortcut holds only for these targets with anchor-less numbers on (reassigned targets: no).
        self._integers_read_plainly = targets if try_extract_without_anchor else None

    def _parse(self, text: str, targets: tuple) -> list:
        """math-verify's `parse(text)`: the extracted values (sympy) followed by the matched string."""
        if not isinstance(text, str):
            return []  # math-verify's parse gives [] for anything but a string
        if targets is self._integers_read_plainly and _PLAIN_INT_RE.fullmatch(text):
            from sympy import Integer

            return [Integer(int(text)), text]
        if len(text) > _CACHE_MAX_CHARS:
            from math_verify.parser import parse

            return parse(text, extraction_config=targets, parsing_timeout=None)
        return list(_parse_cached(text, targets))

    def _equal(self, gold: list, pred: list) -> bool:
        from math_verify.grader import verify

        return bool(gold and pred and verify(gold, pred, float_rounding=self.precision, timeout_seconds=None))

    def _verify_impl(self, response: str, ground_truth: str) -> float:
        """The check itself, without the timeout."""
        gold = self._parse(ground_truth, self.gold_extraction_target)
        pred = self._parse(response, self.pred_extraction_target)
        return 1.0 if self._equal(gold, pred) else 0.0

    def verify(self, response: str, ground_truth: str) -> float:
        try:
            return _call_with_timeout(self._verify_impl, (response, ground_truth), self.timeout)
        except concurrent.futures.TimeoutError:
            logger.warning(
                "math-verify took over %ss on response=%.200r, ground_truth=%.200r: scored 0.0",
                self.timeout,
                response,
                ground_truth,
            )
        except Exception:
            logger.warning(
                "math-verify failed on response=%.200r, ground_truth=%.200r", response, ground_truth, exc_info=True
            )
        return 0.0


_MATH_VERIFY_WORKER: MathVerifyWorker | None = None


def get_math_verify_worker() -> MathVerifyWorker:
    """The process's shared `MathVerifyWorker()` (AReaL's defaults), created on first use."""
    global _MATH_VERIFY_WORKER
    if _MATH_VERIFY_WORKER is None:
        _MATH_VERIFY_WORKER = MathVerifyWorker()
    return _MATH_VERIFY_WORKER


# ============================================================================ one answer vs another
_MAX_SYMBOLIC_CHARS = 1000
# A word of three letters or more that is no function name: a sentence ("The sum is 7"), not a formula (sin(x)+1)
_PROSE_WORD_RE = re.compile(
    r"\b(?!(?:a?(?:sin|cos|tan|cot|sec|csc)h?|arc(?:sin|cos|tan)|log|exp|sqrt|max|min|inf|infty|deg|mod)\b)[A-Za-z]{3,}"
)


def _symbolic_equal(pred: str, gold: str, timeout: float | None) -> bool:
    worker = get_math_verify_worker()

    def read(s: str) -> list:
        # An extracted answer is one expression: read it as LaTeX math first. Bare, math-verify
        # would misread "(x+1)^2" (nothing) or "2^{10}" (just "2").
        got = worker._parse(f"${s}$", worker.gold_extraction_target) if "$" not in s and "\\boxed" not in s else []
        return got or worker._parse(s, worker.gold_extraction_target)

    return bool(_call_with_timeout(lambda: worker._equal(read(gold), read(pred)), (), timeout))


def _seconds(timeout: bool | float | None) -> float | None:
    if timeout is True:
        return get_math_verify_worker().timeout
    return float(timeout) if timeout else None  # False, None, 0: no limit


def math_equal(pred, gold, rel_tol: float = 1e-4, timeout: bool | float | None = True) -> bool:
    """Whether `pred` and `gold` are the same mathematical answer. Never raises.

    timeout: seconds for the symbolic check (True: the math-verify worker's, False/None: no limit).
    """
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
        return _symbolic_equal(pred, gold, _seconds(timeout))
    except concurrent.futures.TimeoutError:  # scored unequal, perhaps wrongly: say so, as MathVerifyWorker does
        logger.warning(
            "math_equal took over %ss on pred=%.200r, gold=%.200r: scored unequal", _seconds(timeout), pred, gold
        )
        return False
    except Exception:  # a reward must not take down a rollout
        logger.debug("math_equal(%r, %r) failed", pred, gold, exc_info=True)
        return False


def _gold_from_solution(answer) -> str | None:
    """The gold answer in a dataset's `answer`: a GSM8K solution's '#### N', a solution's last \\boxed{}, or a
    one-line answer whole: a number, or an expression such as \\frac{\\sqrt{2}}{2}, x^2+1 or (1, 2), which
    `math_equal` compares symbolically (reading one by its last number would pay "2" for \\frac{\\sqrt{2}}{2}).
    Only a worked solution in words falls back to its last number."""
    if answer is None:
        return None
    text = str(answer).strip()
    if _to_number(text)[0] is not None:
        return text
    marked = extract_answer(text, "hash") or parse_boxed(text)
    if marked:
        return marked
    words = _PROSE_WORD_RE.search(re.sub(r"\\[A-Za-z]+", " ", text))  # LaTeX commands (\frac, \pi) are no words
    if text and "\n" not in text and len(text) <= _MAX_SYMBOLIC_CHARS and words is None:
        return text
    return extract_answer(text, "last_number")


def answer_reward(completion, answer, **kwargs) -> float:
    """1.0 if the completion's final answer (boxed → #### → 'the answer is' → last number) equals the gold's.

    Stricter than AReaL's `gsm8k_reward_fn`, which pays any expression in the reply that evaluates to the answer:
    on "What is 4 + 3?" a reply that only restates "4 + 3" scores 1.0 there and 0.0 here. Never raises.
    """
    try:
        gold = _gold_from_solution(answer)
        pred = extract_answer(completion, "auto")
        return 1.0 if gold is not None and math_equal(pred, gold) else 0.0
    except Exception:  # a reward must not take down a rollout
        logger.debug("answer_reward failed", exc_info=True)
        return 0.0
