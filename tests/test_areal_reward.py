"""The kit's rewards against AReaL 1.0.4's own `areal.reward`: the same score on a table of completions (numbers,
LaTeX, fractions, units, GSM8K solutions, garbage, empty), the same signatures and exports, the plain-integer
shortcut equal to math-verify's own reading, and the check working from threads and forked processes, with a timeout
that returns on time (tests/test_reward.py runs the same check in `AsyncRewardWrapper` workers).
"""

from __future__ import annotations

import concurrent.futures
import gc
import importlib
import inspect
import logging
import multiprocessing
import random
import threading
import time

import pytest

import areal_lite.reward as kit_reward
from areal_lite.reward import math_answer
from areal_lite.reward.arithmetic import arithmetic_reward_fn
from areal_lite.reward.clevr_count_70k import clevr_count_70k_reward_fn
from areal_lite.reward.geometry3k import geometry3k_reward_fn
from areal_lite.reward.gsm8k import gsm8k_reward_fn
from areal_lite.reward.math_answer import MathVerifyWorker, extract_answer, math_equal

SOLUTION = "She buys 3 packs of 12 = <<3*12=36>>36 eggs and uses 4, so 36-4 = <<36-4=32>>32.\n#### 32"
MONEY = "He pays $5 + $7 = $<<5+7=12>>12 in all.\n#### 12"

GSM8K_CASES = [
    # plain numbers, both sides (the shortcut) and mixed with text
    ("32", "32"),
    ("-32", "-32"),
    ("32", "-32"),
    ("0", "0"),
    ("-0", "0"),
    ("007", "7"),
    ("123456789012345678901234567890", "123456789012345678901234567890"),
    ("123456789012345678901234567890", "123456789012345678901234567891"),
    (" 32", "32"),
    ("32\n", "32"),
    ("32", SOLUTION),
    ("31", SOLUTION),
    ("12", MONEY),
    ("#### 32", SOLUTION),
    ("The answer is 32.", SOLUTION),
    ("36 - 4 = 32", SOLUTION),
    ("so 32 eggs", SOLUTION),
    ("\\boxed{32}", SOLUTION),
    ("\\boxed{32} no wait \\boxed{36}", SOLUTION),
    ("The final answer is $32$. I hope it is correct.", SOLUTION),
    ("Answer: 32", "32"),
    ("final answer: 1,500", "1500"),
    ("1,500", "1.5"),
    ("32.0", "32"),
    ("32.0000001", "32"),
    ("0.333333", "1/3"),
    ("$12", "12"),
    ("12 dollars", "12"),
    ("12%", "0.12"),
    ("50%", "50"),
    # LaTeX, fractions, powers, symbols
    ("$\\frac{64}{2}$", "32"),
    ("\\frac{1}{2}", "0.5"),
    ("\\dfrac{3}{4}", "3/4"),
    ("$2^5$", "32"),
    ("$\\sqrt{1024}$", "32"),
    ("$2\\pi$", "2*pi"),
    ("$\\pi$", "3.14159265"),
    ("x = 32", "32"),
    ("$x^2+2x+1$", "$(x+1)^2$"),
    ("\\{1, 2\\}", "\\{2, 1\\}"),
    ("$(1, 2)$", "(1,2)"),
    ("$\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}$", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"),
    ("3+2", "5"),
    ("12/3", "4"),
    # garbage, empty, odd types
    ("", "32"),
    ("32", ""),
    ("", ""),
    ("   ", "32"),
    ("I don't know", SOLUTION),
    ("!!!", "32"),
    ("\\boxed{", "32"),
    ("\\frac{", "}{"),
    ("None", "None"),
    ("%$#@", "0"),
    ("数字是 32", "32"),
    ("32 " * 400, "32"),
    (None, SOLUTION),
    ("32", None),
    (32, 32),
]


@pytest.fixture(scope="module")
def areal_reward():
    return importlib.import_module("areal.reward")


@pytest.mark.parametrize("completion,answer", GSM8K_CASES)
def test_gsm8k_reward_equals_areals(areal_reward, completion, answer):
    theirs = areal_reward.gsm8k_reward_fn("q", completion, [1], [2], answer)
    ours = gsm8k_reward_fn("q", completion, [1], [2], answer)
    assert type(ours) is type(theirs) is float
    assert ours == theirs, (completion, answer)


@pytest.mark.parametrize("completion", ["4 + 3", "To find 4 + 3, add them.", "I think it's 4 + 3"])
def test_arithmetic_reward_pays_the_final_answer_only(areal_reward, completion):
    """The kit's arithmetic tasks use their own reward on purpose: AReaL's GSM8K check pays a restated question."""
    gold = "4 + 3 = 7\n#### 7"
    assert areal_reward.gsm8k_reward_fn("What is 4 + 3?", completion, [1], [2], gold) == 1.0
    assert gsm8k_reward_fn("What is 4 + 3?", completion, [1], [2], gold) == 1.0
    assert arithmetic_reward_fn("What is 4 + 3?", completion, [1], [2], gold) == 0.0
    assert arithmetic_reward_fn("What is 4 + 3?", completion + " = 7", [1], [2], gold) == 1.0


GEOMETRY_CASES = [
    ("The angle is [60].", "60"),
    ("The angle is [60].", "[60]"),
    ("[59]", "60"),
    ("[ 60 ]", "60"),
    ("[60 degrees]", "60"),
    ("[1/2]", "0.5"),
    ("[$\\frac{\\sqrt{3}}{2}$]", "\\frac{\\sqrt{3}}{2}"),
    ("[2\\sqrt{3}]", "2\\sqrt{3}"),
    ("[3.464]", "2\\sqrt{3}"),
    ("first [30] then [45]", "45"),
    ("no brackets, 1,200 here", "1200"),
    ("x2 and .5", "0.5"),
    ("nothing", "60"),
    ("", "60"),
    ("[60]", ""),
    ("[60]", None),
    (None, "60"),
]


@pytest.mark.parametrize("completion,answer", GEOMETRY_CASES)
def test_geometry3k_reward_equals_areals(areal_reward, completion, answer):
    theirs = areal_reward.geometry3k_reward_fn("q", completion, [], [], answer)
    assert geometry3k_reward_fn("q", completion, [], [], answer) == theirs


@pytest.mark.parametrize("text", ["a [3] b [4.5]", "[x] 7", "", "[ 3 ]", "3", "[1][2]"])
@pytest.mark.parametrize("use_last_number", [True, False])
def test_geometry3k_extract_answer_equals_areals(text, use_last_number):
    from areal.reward.geometry3k import extract_answer as theirs

    from areal_lite.reward.geometry3k import extract_answer as ours

    assert ours(text, use_last_number) == theirs(text, use_last_number)


@pytest.mark.parametrize(
    "completion,answer", [("There are [3] cubes", "3"), ("[3]", " 3 "), ("[4]", "3"), ("3", "3"), ("[3.0]", "3")]
)
def test_clevr_reward_equals_areals(areal_reward, completion, answer):
    theirs = areal_reward.clevr_count_70k_reward_fn("q", completion, [], [], answer)
    assert clevr_count_70k_reward_fn("q", completion, [], [], answer) == theirs


def test_clevr_reward_scores_zero_where_areals_raises(areal_reward):
    # Deliberate difference: AReaL's raises on a completion or answer that is not a string; a kit reward never raises.
    assert clevr_count_70k_reward_fn("q", "[3]", [], [], None) == areal_reward.clevr_count_70k_reward_fn(
        "q", "[3]", [], [], None
    )
    for completion, answer, error in [(None, "3", TypeError), ("[3]", 3, AttributeError)]:
        with pytest.raises(error):
            areal_reward.clevr_count_70k_reward_fn("q", completion, [], [], answer)
        assert clevr_count_70k_reward_fn("q", completion, [], [], answer) == 0.0


@pytest.mark.parametrize("anchorless,precision", [(True, 6), (False, 6), (True, 2)])
@pytest.mark.parametrize(
    "response,gold",
    [
        ("\\boxed{0.667}", "2/3"),
        ("72", "answer: 72"),
        ("it is 72", "72"),
        ("final answer is 72", "72"),
        ("3.14", "3.1"),
    ],
)
def test_worker_settings_equal_areals(areal_reward, anchorless, precision, response, gold):
    theirs = areal_reward.MathVerifyWorker(try_extract_without_anchor=anchorless, precision=precision, timeout=None)
    ours = MathVerifyWorker(try_extract_without_anchor=anchorless, precision=precision, timeout=None)
    assert ours.verify(response, gold) == theirs.verify(response, gold)


def test_plain_integers_read_as_math_verify_reads_them():
    from math_verify.parser import parse

    worker = math_answer.get_math_verify_worker()
    rng = random.Random(0)
    texts = ["0", "-1", "9" * 30, "-" + "9" * 30] + [str(rng.randint(-(10**12), 10**12)) for _ in range(200)]
    for text in texts:
        assert math_answer._PLAIN_INT_RE.fullmatch(text), text
        theirs = parse(text, extraction_config=worker.gold_extraction_target, parsing_timeout=None)
        ours = worker._parse(text, worker.gold_extraction_target)
        assert ours == theirs and [type(x) for x in ours] == [type(x) for x in theirs], text


# ------------------------------------------------------------------------------------ names and signatures
def test_package_exports_areals_names(areal_reward):
    assert sorted(kit_reward.__all__) == sorted(areal_reward.__all__)
    for name in areal_reward.__all__:
        assert callable(getattr(kit_reward, name)), name


@pytest.mark.parametrize(
    "path,name",
    [
        ("reward", "get_math_verify_worker"),
        ("reward", "MathVerifyWorker"),
        ("reward.gsm8k", "gsm8k_reward_fn"),
        ("reward.geometry3k", "geometry3k_reward_fn"),
        ("reward.geometry3k", "extract_answer"),
        ("reward.clevr_count_70k", "clevr_count_70k_reward_fn"),
        ("reward.clevr_count_70k", "extract_answer"),
    ],
)
def test_signatures_equal_areals(path, name):
    ours = getattr(importlib.import_module(f"areal_lite.{path}"), name)
    theirs = getattr(importlib.import_module(f"areal.{path}"), name)
    for attr in ("__init__", "verify", "_verify_impl") if inspect.isclass(theirs) else (None,):
        o, t = (getattr(ours, attr), getattr(theirs, attr)) if attr else (ours, theirs)
        po, pt = inspect.signature(o).parameters.values(), inspect.signature(t).parameters.values()
        assert [(p.name, p.kind, p.default) for p in po] == [(p.name, p.kind, p.default) for p in pt], (name, attr)


def test_worker_defaults_and_singleton(areal_reward):
    ours, theirs = math_answer.get_math_verify_worker(), areal_reward.get_math_verify_worker()
    assert ours is math_answer.get_math_verify_worker()
    assert (ours.precision, ours.timeout) == (theirs.precision, theirs.timeout)
    assert ours.gold_extraction_target == theirs.gold_extraction_target
    assert ours.pred_extraction_target == theirs.pred_extraction_target


# ------------------------------------------------------------------------------------ threads, processes, timeouts
def test_scores_the_same_from_threads():
    cases = [(c, a) for c, a in GSM8K_CASES if isinstance(c, str) and len(c) < 100]
    expected = [gsm8k_reward_fn("q", c, [], [], a) for c, a in cases]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda ca: gsm8k_reward_fn("q", ca[0], [], [], ca[1]), cases))
    assert got == expected


def test_check_threads_end_with_their_callers():
    def checkers() -> set:
        return {t for t in threading.enumerate() if t.name == "math-verify"}

    before = checkers()
    for _ in range(20):
        caller = threading.Thread(target=gsm8k_reward_fn, args=("q", "\\boxed{32}", [], [], SOLUTION))
        caller.start()
        caller.join()
    gc.collect()
    for checker in checkers() - before:  # each must end once its caller has: wait for that, up to 5 s
        checker.join(timeout=5)
    assert len(checkers()) <= len(before)


def _score_in_child(queue) -> None:
    queue.put(gsm8k_reward_fn("q", "The answer is $\\frac{64}{2}$", [], [], SOLUTION))


def test_a_forked_child_gets_its_own_check_thread():
    # The parent's check thread does not survive fork; the child must not queue work for it and time out.
    assert gsm8k_reward_fn("q", "\\boxed{32}", [], [], SOLUTION) == 1.0
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_score_in_child, args=(queue,))
    start = time.monotonic()
    child.start()
    assert queue.get(timeout=20) == 1.0
    child.join(timeout=20)
    assert time.monotonic() - start < 4  # well under the worker's 5 s timeout


def test_an_overrunning_check_scores_zero_on_time(monkeypatch):
    worker = MathVerifyWorker(timeout=0.2)
    monkeypatch.setattr(worker, "_verify_impl", lambda response, gold: time.sleep(1.5) or 1.0)
    # A handler on the module's own logger, not pytest's caplog on the root: importing areal (other tests here do)
    # replaces `logging.Logger.root`, so a logger made before that no longer reaches the root caplog watches.
    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    math_answer.logger.addHandler(handler)
    start = time.monotonic()
    try:
        assert worker.verify("32", "32") == 0.0
    finally:
        math_answer.logger.removeHandler(handler)
    assert time.monotonic() - start < 1.0 and any("took over 0.2s" in w for w in warnings), warnings
    monkeypatch.undo()
    assert worker.verify("32", "32") == 1.0  # a fresh check thread serves the next call at once
    assert worker.verify("\\boxed{1/2}", "0.5") == 1.0


# ------------------------------------------------------------------------------------ the kit's helpers
def test_seed_notebook_calls():
    # The seed notebook's reward: extract_answer(text, "math", use_last_number) and math_equal(x, y, timeout=False).
    x = extract_answer("so \\boxed{72}", "math", True)
    y = extract_answer("48 + 24 = 72 clips.\n#### 72", "math", use_last_number=True)
    assert (x, y) == ("72", "72") and math_equal(x, y, timeout=False) is True
    assert extract_answer("it is 72", "gsm8k", False) is None
    assert math_equal("(x+1)^2", "x^2+2x+1", timeout=2.0) is True
    assert math_equal("x^2", "x^3", timeout=True) is False
