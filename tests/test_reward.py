"""areal_lite.reward (math_answer, gsm8k, search_qa): extraction, math equivalence, F1/EM, the process-pool
wrapper."""

import asyncio
import os
import sys
import threading
import time

import psutil
import pytest
from test_procs import wait_until  # one copy of the polling helper

from areal_lite.api.reward_api import AsyncRewardWrapper
from areal_lite.reward.gsm8k import gsm8k_reward_fn
from areal_lite.reward.math_answer import answer_reward, extract_answer, math_equal
from areal_lite.reward.search_qa import exact_match, f1_score, normalize_answer

GSM8K_SOLUTION = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)

# ----------------------------------------------------------------------------- extraction
EXTRACT_CASES = [
    ("so \\boxed{72}", "auto", "72"),
    ("\\boxed{\\frac{1}{2}} then \\boxed{\\frac{3}{4}}", "auto", "\\frac{3}{4}"),
    ("\\boxed{a{b{c}}d}", "boxed", "a{b{c}}d"),
    ("\\fbox{7}", "boxed", "7"),
    ("\\boxed{5} and \\boxed{6", "boxed", "5"),  # unclosed last box: the last complete one wins
    ("\\boxed{", "boxed", None),
    ("work\n#### 1,234", "auto", "1,234"),
    ("#### 5\n#### 6.", "hash", "6"),
    ("The answer is 42.", "auto", "42"),
    ("Final answer: $3.50", "phrase", "$3.50"),
    ("Therefore, the final answer is **18**.", "auto", "18"),
    ("I think 3 apples plus 4 apples make 7 apples", "auto", "7"),
    ("it is -12.5 degrees", "last_number", "-12.5"),
    ("costs 1,000,000 dollars", "last_number", "1,000,000"),
    ("no numbers here", "auto", None),
    ("", "auto", None),
    (None, "auto", None),
    ("\\boxed{9} #### 10", "hash", "10"),
]


@pytest.mark.parametrize("text,mode,expected", EXTRACT_CASES)
def test_extract_answer(text, mode, expected):
    assert extract_answer(text, mode) == expected


def test_extract_answer_rejects_unknown_mode():
    with pytest.raises(ValueError):
        extract_answer("1", "bogus")


# ----------------------------------------------------------------------------- math equivalence
EQUAL = [
    ("72", "72"),
    ("72.0", "72"),
    ("72.00", "72"),
    ("1,234", "1234"),
    ("1,234,567.5", "1234567.5"),
    ("$18", "18"),
    ("\\$18", "18"),
    ("$18.00", "18"),
    ("18 dollars", "18"),
    ("18 apples", "18"),
    ("5 cm", "5"),
    ("12 km", "12"),
    ("3 hours", "3"),
    ("20 square meters", "20"),
    ("7 m^2", "7"),
    ("50%", "50"),
    ("50\\%", "0.5"),
    ("25 percent", "0.25"),
    ("3/4", "0.75"),
    ("\\frac{3}{4}", "0.75"),
    ("\\dfrac{3}{4}", "3/4"),
    ("\\tfrac12", "0.5"),
    ("-\\frac{1}{2}", "-0.5"),
    ("1 1/2", "1.5"),
    ("-5", "-5"),
    ("\u22125", "-5"),
    ("-0.25", "-1/4"),
    (".5", "0.5"),
    ("0.3333", "1/3"),
    ("1e3", "1000"),
    ("42.", "42"),
    ("\\text{42 dollars}", "42"),
    ("\\textbf{9}", "9"),
    ("x = 3", "3"),
    ("= 3", "3"),
    ("$\\frac{1}{\\sqrt{2}}$", "\\frac{\\sqrt{2}}{2}"),
    ("(x+1)^2", "x^2+2x+1"),
    ("\\sqrt{16}", "4"),
    ("2^{10}", "1024"),
    ("\\{1,2\\}", "\\{2,1\\}"),
    ("\\pi", "\\pi"),
    ("18 per day", "18"),
    ("10 m", "10"),
    ("1000000", "1,000,000"),
    ("0.1", "1/10"),
]
NOT_EQUAL = [
    ("71", "72"),
    ("7.2", "72"),
    ("-72", "72"),
    ("0.333", "1/3"),
    ("3/4", "4/3"),
    ("\\frac{3}{4}", "0.7"),
    ("1,234", "1.234"),
    ("50%", "5"),
    ("1000", "1,001"),
    ("x^2", "x^3"),
    ("\\sqrt{2}", "1.41"),
    ("apple", "72"),
    ("", "72"),
    (None, "72"),
    ("72", None),
    ("None", "72"),
    ("3 + 4", "8"),
    ("2 hours 30 minutes", "2"),
    ("1/0", "0"),
    ("\\boxed{", "5"),
    ("100000", "100001"),
    ("-0.5", "0.5"),
]


@pytest.mark.parametrize("pred,gold", EQUAL)
def test_math_equal_true(pred, gold):
    assert math_equal(pred, gold) is True


@pytest.mark.parametrize("pred,gold", NOT_EQUAL)
def test_math_equal_false(pred, gold):
    assert math_equal(pred, gold) is False


def test_math_equal_tolerance_is_relative():
    assert math_equal("1000.05", "1000", rel_tol=1e-4)
    assert not math_equal("1000.5", "1000", rel_tol=1e-4)


def test_math_equal_never_raises_on_odd_input():
    for junk in [object(), 3, 3.0, ["1"], "\\frac{", "}{", "\\boxed{\\frac{1}{0}}", "x" * 5000, "%$#@"]:
        assert math_equal(junk, "3") in (True, False)


def test_math_equal_off_main_thread():
    # math_verify's signal-based timeout fails off the main thread; we must not.
    results = []
    t = threading.Thread(target=lambda: results.append(math_equal("(x+1)^2", "x^2+2x+1")))
    t.start()
    t.join()
    assert results == [True]


# ----------------------------------------------------------------------------- gsm8k reward
@pytest.mark.parametrize(
    "completion,answer,expected",
    [
        ("\\boxed{72}", GSM8K_SOLUTION, 1.0),
        ("She sold 72 clips. #### 72", GSM8K_SOLUTION, 1.0),
        ("The answer is 72.", GSM8K_SOLUTION, 1.0),
        ("So 48 + 24 = 72", GSM8K_SOLUTION, 1.0),
        ("The answer is $72.00", GSM8K_SOLUTION, 1.0),
        ("\\boxed{71}", GSM8K_SOLUTION, 0.0),
        ("\\boxed{72} wait no \\boxed{24}", GSM8K_SOLUTION, 0.0),
        ("I don't know", GSM8K_SOLUTION, 0.0),
        ("", GSM8K_SOLUTION, 0.0),
        (None, GSM8K_SOLUTION, 0.0),
        ("\\boxed{1,500}", "1500", 1.0),  # reasoning-gym style gold: the bare number
        ("\\boxed{3}", "", 0.0),
        ("\\boxed{3}", None, 0.0),
    ],
)
def test_gsm8k_reward_fn(completion, answer, expected):
    assert answer_reward(completion, answer) == expected


@pytest.mark.parametrize(
    "completion,answer,expected",
    [
        ("The answer is $\\frac{\\sqrt{2}}{2}$", "\\frac{\\sqrt{2}}{2}", 1.0),
        ("The answer is 2", "\\frac{\\sqrt{2}}{2}", 0.0),  # not the gold's last number
        ("\\boxed{x^2+1}", "x^2+1", 1.0),
        ("\\boxed{1}", "x^2+1", 0.0),
        ("\\boxed{(1, 2)}", "(1, 2)", 1.0),
        ("\\boxed{2}", "(1, 2)", 0.0),
        ("\\boxed{\\pi}", "\\pi", 1.0),
        ("\\boxed{2\\pi}", "2\\pi", 1.0),
        ("\\boxed{\\pi}", "2\\pi", 0.0),
        ("\\boxed{2\\sin(x)\\cos(x)}", "\\sin(2x)", 1.0),
        ("\\boxed{0.5}", "$\\frac{1}{2}$", 1.0),
        ("\\boxed{x+1}", "Adding one gives \\boxed{x+1}", 1.0),  # a solution's boxed answer
        ("\\boxed{72}", "Half of 48 is 24, and 48 + 24 = 72", 1.0),  # a worked solution in words: its last number
    ],
)
def test_a_symbolic_gold_answer_is_compared_whole(completion, answer, expected):
    """A one-line gold expression is the answer, compared symbolically; read by its last number, the correct answer
    to \\frac{\\sqrt{2}}{2} scored 0 and "2" scored 1."""
    assert answer_reward(completion, answer) == expected


def test_areal_signature_adapter():
    assert gsm8k_reward_fn("prompt", "\\boxed{72}", [1, 2], [3], GSM8K_SOLUTION, extra=1) == 1.0
    assert gsm8k_reward_fn("prompt", "\\boxed{7}", [1, 2], [3], answer=GSM8K_SOLUTION) == 0.0


# ----------------------------------------------------------------------------- F1 / EM
@pytest.mark.parametrize(
    "s,expected",
    [
        ("The  Eiffel Tower!", "eiffel tower"),
        ("A cat, an owl.", "cat owl"),
        ("  Hello\tWorld ", "hello world"),
        ("there", "there"),  # "the" only as a whole word
        ("", ""),
    ],
)
def test_normalize_answer(s, expected):
    assert normalize_answer(s) == expected


F1_CASES = [
    # (pred, gold, mode, expected)
    ("James Bond", "James Bond", "multiset", 1.0),
    ("James Bond", "James Bond", "set", 1.0),
    ("James Smith", "James Bond", "multiset", 0.5),
    ("James Smith", "James Bond", "set", 0.5),
    ("the Eiffel Tower", "Eiffel Tower", "multiset", 1.0),
    ("Eiffel", "Eiffel Tower", "multiset", 2 / 3),
    ("Paris Paris Paris", "Paris", "multiset", 0.5),  # multiset: precision 1/3, recall 1
    ("Paris Paris Paris", "Paris", "set", 1.0),  # set: duplicates collapse
    ("new york new york", "new york", "multiset", 2 / 3),
    ("new york new york", "new york", "set", 1.0),
    ("London", "Paris", "multiset", 0.0),
    ("London", "Paris", "set", 0.0),
    ("yes", "no", "multiset", 0.0),
    ("yes", "yes", "set", 1.0),
    ("yes it is", "yes", "multiset", 0.0),  # yes/no must match exactly
    ("no", "no answer here", "set", 0.0),
    ("noanswer", "noanswer", "multiset", 1.0),
    (None, "Paris", "multiset", 0.0),
    (None, "Paris", "set", 0.0),
    ("", "Paris", "multiset", 0.0),
    ("Paris", ["London", "Paris"], "multiset", 1.0),
    ("Paris France", ["London", "Paris"], "set", 2 / 3),
    ("Paris", [], "multiset", 0.0),
    ("Paris", ("Paris",), "set", 1.0),
    ("PARIS!", "paris", "multiset", 1.0),
    ("a b c d", "a b", "multiset", 0.5),  # "a" is an article and is dropped → "b c d" vs "b"
    ("Barack Obama", "Obama", "set", 2 / 3),
    ("1997", "1997", "set", 1.0),
]


@pytest.mark.parametrize("pred,gold,mode,expected", F1_CASES)
def test_f1_score(pred, gold, mode, expected):
    assert f1_score(pred, gold, mode=mode) == pytest.approx(expected)


def test_f1_rejects_bad_mode():
    with pytest.raises(ValueError):
        f1_score("a", "a", mode="bag")


@pytest.mark.parametrize(
    "pred,gold,expected",
    [
        ("Paris", "paris", 1.0),
        ("The Paris.", "Paris", 1.0),
        ("Paris, France", "Paris", 0.0),
        ("Paris", ["London", "PARIS"], 1.0),
        (None, "Paris", 0.0),
        ("Paris", [], 0.0),
        ("yes", "Yes.", 1.0),
    ],
)
def test_exact_match(pred, gold, expected):
    assert exact_match(pred, gold) == expected


# ----------------------------------------------------------------------------- async wrapper
# Module-level functions so worker processes can import them.
def slow_reward(x, delay=0.0):
    time.sleep(delay)
    return float(x)


def marked_slow_reward(mark: str, delay: float) -> float:
    """`slow_reward` that first creates the file `mark`: a test waits for the file to know a worker took the call."""
    open(mark, "w").close()
    time.sleep(delay)
    return 1.0


def crashing_reward(x):
    raise RuntimeError("boom")


def dying_reward(x):
    os._exit(3)  # kills the worker process: BrokenProcessPool


def string_reward(x):
    return "1.0"


def nan_reward(x):
    return float("nan")


def huge_reward(x):
    return 10**400  # a number, but float() overflows


class _NoFloat:
    def __float__(self):
        raise RuntimeError("no float here")


def no_float_reward(x):
    return _NoFloat()


def exiting_reward(x):
    sys.exit(1)  # SystemExit travels back from the worker as the call's exception


def interrupting_reward(x):
    raise KeyboardInterrupt


@pytest.fixture
def wrapper():
    # Every call that should succeed must do so inside this timeout, a fresh worker importing this module included
    # (a new pool's start is not charged to the call: test_wrapper_pool_start_is_not_charged_to_the_call). The
    # hanging calls sleep 60 s, so 5 s still tells a timeout from a hang on a loaded machine.
    w = AsyncRewardWrapper(slow_reward, timeout_seconds=5.0, max_workers=2)
    yield w
    w.shutdown()


def _children():
    return {p.pid for p in psutil.Process().children(recursive=True)}


def test_wrapper_basic_and_stats(wrapper):
    async def go():
        await wrapper.warmup()
        return [await wrapper(3), await wrapper(x=2)]

    assert asyncio.run(go()) == [3.0, 2.0]
    assert wrapper.stats == {"calls": 2, "timeouts": 0, "errors": 0, "pool_restarts": 0}


def test_wrapper_timeout_then_keeps_serving(wrapper):
    async def go():
        await wrapper.warmup()
        t0 = time.monotonic()
        assert await wrapper(1, delay=60) == 0.0
        assert time.monotonic() - t0 < 30  # the 5 s timeout, not the 60 s hang (room for a loaded machine)
        assert wrapper.stats["timeouts"] == 1
        # The hung worker was killed and a fresh pool serves both slots again.
        return await asyncio.gather(*[wrapper(i) for i in range(4)])

    assert asyncio.run(go()) == [0.0, 1.0, 2.0, 3.0]
    assert wrapper.stats["timeouts"] == 1 and wrapper.stats["errors"] == 0
    assert wrapper.stats["pool_restarts"] == 1


def test_wrapper_pool_start_is_not_charged_to_the_call(monkeypatch):
    """Starting a pool (after a crash or a hang killed the last one) can take seconds on a loaded machine: it runs
    off the event loop, which keeps serving, and it does not count against the reward's timeout."""
    import areal_lite.api.reward_api as reward_module

    real_start = reward_module._start_pool

    def slow_start(max_workers):
        time.sleep(2.0)  # a pool start slower than the whole timeout below
        return real_start(max_workers)

    monkeypatch.setattr(reward_module, "_start_pool", slow_start)
    w = AsyncRewardWrapper(slow_reward, timeout_seconds=1.5, max_workers=1)

    async def go():
        gaps, last, done = [], time.monotonic(), asyncio.Event()

        async def ticker():  # measures how long the loop goes without running other tasks
            nonlocal last
            while not done.is_set():
                await asyncio.sleep(0.01)
                gaps.append(time.monotonic() - last)
                last = time.monotonic()

        tick = asyncio.ensure_future(ticker())
        value = await w(4)
        done.set()
        await tick
        return value, max(gaps)

    try:
        value, longest_gap = asyncio.run(go())
    finally:
        w.shutdown()
    assert value == 4.0 and w.stats["timeouts"] == 0  # the 2 s start was not charged to the 1.5 s call
    assert longest_gap < 1.0  # the loop kept running while the pool started


def test_start_workers_runs_the_pool_before_the_first_call(wrapper):
    """`start_workers()` returns at once and starts the workers on a thread (kit.trainer.train starts them while the
    server loads); the first call then uses that pool, and a wrapper shut down first starts nothing."""
    thread = wrapper.start_workers()
    thread.join(timeout=120)
    assert not thread.is_alive()
    pool = wrapper._pool
    assert pool is not None and len(pool._processes) == wrapper.max_workers
    assert all(psutil.pid_exists(pid) for pid in pool._processes)
    assert asyncio.run(wrapper(2)) == 2.0
    assert wrapper._pool is pool and wrapper.stats["pool_restarts"] == 0
    closed = AsyncRewardWrapper(slow_reward)
    closed.shutdown()
    closed.start_workers().join(timeout=60)
    assert closed._pool is None


def test_wrapper_timeout_does_not_fail_concurrent_calls(wrapper):
    async def go():
        await wrapper.warmup()
        return await asyncio.gather(wrapper(5, delay=60), wrapper(7, delay=0.3))

    assert asyncio.run(go()) == [0.0, 7.0]  # the innocent call was retried on the fresh pool
    assert wrapper.stats["timeouts"] == 1 and wrapper.stats["errors"] == 0


BAD_REWARDS = [crashing_reward, string_reward, nan_reward, huge_reward, no_float_reward, exiting_reward]


@pytest.mark.parametrize("fn", BAD_REWARDS + [interrupting_reward])
def test_wrapper_exception_and_bad_values_count_as_errors(fn):
    with AsyncRewardWrapper(fn, timeout_seconds=10) as w:
        assert asyncio.run(w(1)) == 0.0
        assert w.stats["errors"] == 1 and w.stats["timeouts"] == 0
        assert asyncio.run(w(2)) == 0.0  # the pool still answers
        assert w.stats["errors"] == 2


def test_wrapper_recovers_from_dead_worker():
    with AsyncRewardWrapper(dying_reward, timeout_seconds=10) as w:
        assert asyncio.run(w(1)) == 0.0
        assert w.stats["errors"] == 1 and w.stats["pool_restarts"] >= 1
        # Same wrapper, new pool, still serving (and still failing cleanly).
        assert asyncio.run(w(2)) == 0.0
        assert w.stats["errors"] == 2


def test_wrapper_runs_real_reward_inside_running_loop():
    async def go(w):
        return [
            await w("\\boxed{72}", GSM8K_SOLUTION),
            await w(None, GSM8K_SOLUTION),
            await w("The answer is 72", GSM8K_SOLUTION),
        ]

    with AsyncRewardWrapper(answer_reward, timeout_seconds=10) as w:
        assert asyncio.run(go(w)) == [1.0, 0.0, 1.0]
        assert w.stats["errors"] == 0


def test_wrapper_from_background_thread_loop(wrapper):
    # The rollout engine runs workflows in a background thread's own event loop.
    out = []

    def runner():
        out.append(asyncio.run(wrapper(6)))

    t = threading.Thread(target=runner)
    t.start()
    t.join(timeout=30)
    assert out == [6.0]
    # And the same wrapper from a second loop afterwards.
    assert asyncio.run(wrapper(8)) == 8.0


def test_wrapper_ships_notebook_functions_by_value():
    # A function defined in a notebook lives in __main__, which worker processes cannot import.
    namespace = {"__name__": "__main__"}
    exec("def notebook_reward(x):\n    return x * 2.0\n", namespace)
    fn = namespace["notebook_reward"]
    assert fn.__module__ == "__main__"
    with AsyncRewardWrapper(fn, timeout_seconds=10) as w:
        assert asyncio.run(w(4)) == 8.0
        assert w.stats["errors"] == 0


def test_wrapper_rejects_unpicklable():
    with pytest.raises(TypeError):
        AsyncRewardWrapper(lambda x: 1.0)
    with pytest.raises(TypeError):
        AsyncRewardWrapper(42)


def test_wrapper_shutdown_leaves_no_processes():
    before = _children()
    w = AsyncRewardWrapper(slow_reward, timeout_seconds=5, max_workers=2)
    assert asyncio.run(w(1)) == 1.0
    w.shutdown()
    deadline = time.monotonic() + 30
    # The forkserver itself may remain (it is shared and exits with us); the pool workers must not.
    while time.monotonic() < deadline:
        leftover = [p for p in _children() - before if not _is_mp_helper(p)]
        if not leftover:
            break
        time.sleep(0.1)
    assert leftover == []
    with pytest.raises(RuntimeError):
        asyncio.run(w(1))


def _is_mp_helper(pid) -> bool:
    """multiprocessing's shared forkserver / resource tracker (one per interpreter, exit with it)."""
    try:
        cmd = " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return True  # already gone
    return "forkserver" in cmd or "resource_tracker" in cmd


HUNG_AT_EXIT = """
import asyncio, os, sys, time
from areal_lite.api.reward_api import AsyncRewardWrapper
sys.path.insert(0, {tests!r})
from test_reward import marked_slow_reward

async def main():
    w = AsyncRewardWrapper(marked_slow_reward, timeout_seconds=600, max_workers=2)
    await w.warmup()  # returns once every worker exists, however slowly the pool starts
    workers = sorted(w._pool._processes)
    asyncio.ensure_future(w({mark!r}, delay=600))  # still running when the interpreter exits
    deadline = time.monotonic() + 60
    while not os.path.exists({mark!r}):  # the reward creates it first: a worker has taken the call
        assert time.monotonic() < deadline, "no worker took the call within 60 s"
        await asyncio.sleep(0.01)
    print(" ".join(map(str, workers)), flush=True)
    print(" ".join(str(p.pid) for p in __import__("psutil").Process().children(recursive=True)), flush=True)

asyncio.run(main())
"""


HOLDS_A_POOL = """
import asyncio, os, sys, time
from areal_lite.api.reward_api import AsyncRewardWrapper

async def main():
    w = AsyncRewardWrapper(len, max_workers=2)
    assert await w("abcd") == 4.0
    queues = (w._pool._call_queue, w._pool._result_queue)
    names = [getattr(q, a)._semlock.name for q in queues for a in ("_rlock", "_wlock", "_sem") if hasattr(q, a)]
    print(" ".join(names), flush=True)
    assert await w("abcdef") == 6.0  # the pool still works with its names gone
    print("ok", flush=True)
    if sys.argv[1] == "hold":
        sys.stdin.read()  # until the test closes it (or dies): the group is killed before that

asyncio.run(main())
"""


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="POSIX named semaphores live in /dev/shm on Linux")
def test_a_killed_process_group_leaves_no_semaphore_names_behind():
    """A notebook kernel stopped by nbval, or by Jupyter after its grace period, is killed with its process group:
    multiprocessing's resource tracker dies too, and the reward pool's five named semaphores stayed in /dev/shm
    until reboot (measured: 5 per notebook run, 40 per CI run). The pool removes the names once every worker has
    opened them: none exists while it runs, after a SIGKILL of the whole group, or after a normal exit (which must
    not trip over the names being gone)."""
    import contextlib
    import signal
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}

    def shm(names):
        return [n for n in names if os.path.exists("/dev/shm/sem." + n.lstrip("/"))]

    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    child = subprocess.Popen([sys.executable, "-c", HOLDS_A_POOL, "hold"], env=env, text=True, start_new_session=True,
                             **pipes)  # fmt: skip
    try:
        names = child.stdout.readline().split()
        assert len(names) == 5, (names, child.stderr.read() if child.poll() is not None else "")
        assert child.stdout.readline().strip() == "ok"
        assert shm(names) == []
    finally:
        with contextlib.suppress(ProcessLookupError):  # a child that failed early has gone already
            os.killpg(child.pid, signal.SIGKILL)
        child.wait(timeout=30)

    def group_alive() -> bool:  # the pool's workers, its forkserver and resource tracker share the child's group
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                if os.getpgid(p.pid) == child.pid and p.status() != psutil.STATUS_ZOMBIE:
                    return True
        return False

    assert wait_until(lambda: not group_alive(), timeout=30)
    assert shm(names) == []

    out = subprocess.run([sys.executable, "-c", HOLDS_A_POOL, "exit"], env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert shm(out.stdout.split()[:5]) == []


def test_exit_with_a_hung_reward_is_quick_and_kills_workers(tmp_path):
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    script = HUNG_AT_EXIT.format(tests=os.path.join(root, "tests"), mark=str(tmp_path / "taken"))
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert time.monotonic() - t0 < 120  # not blocked by the 600 s reward (room for slow imports on a loaded machine)
    workers, children = ([int(p) for p in line.split()] for line in out.stdout.splitlines())
    # Both workers existed (one of them in the hung call) and were the child's processes when it exited.
    assert len(workers) == 2 and set(workers) <= set(children), out.stdout

    def alive():
        left = []
        for p in children:
            try:
                if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                    left.append(p)
            except psutil.NoSuchProcess:
                pass
        return left

    # The workers are killed at exit; the forkserver and resource tracker leave when they see their parent gone, a
    # moment later: awaited, not asserted after a fixed wait.
    assert wait_until(lambda: not alive(), timeout=30), alive()


@pytest.mark.parametrize(
    "text,expected",
    [
        (r"$\frac{144}{2}$ clips", r"\frac{144}{2}"),  # a LaTeX fraction is one number, not its denominator
        (r"so \frac{3}{4} then 5", "5"),
        (r"-\dfrac{1}{2}", r"-\dfrac{1}{2}"),
    ],
)
def test_last_number_reads_latex_fractions_whole(text, expected):
    assert extract_answer(text) == expected


def test_latex_fraction_completion_is_rewarded():
    assert answer_reward(r"She has $\frac{144}{2}$ clips", "#### 72") == 1.0


UNGUARDED_SCRIPT = """
import asyncio, concurrent.futures, multiprocessing, sys
print("SETUP RAN", flush=True)


def reward(prompt, completions, prompt_ids, completion_ids, **data):
    return float(len(completions))


def square(x):
    return x * x


if sys.argv[1] == "raw":  # what a plain forkserver pool does with this script
    pool = concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("forkserver"))
    print("results", list(pool.map(square, [1, 2, 3, 4])), flush=True)
    pool.shutdown()
else:
    from areal_lite import AsyncRewardWrapper

    w = AsyncRewardWrapper(reward, timeout_seconds=60, max_workers=2)

    async def go():
        return await asyncio.gather(*(w("p", "abc", [], []) for _ in range(4)))

    print("results", asyncio.run(go()), flush=True)
"""


def test_a_script_without_main_guard_runs_its_setup_once(tmp_path):
    """AReaL experiments are scripts. A forkserver/spawn worker re-imports the script that started it, re-running
    unguarded top-level code in every worker; the kit's reward pool starts its workers without it."""
    import subprocess
    import sys

    script = tmp_path / "experiment.py"
    script.write_text(UNGUARDED_SCRIPT)
    run = {
        mode: subprocess.run(
            [sys.executable, str(script), mode], capture_output=True, text=True, timeout=300, cwd=tmp_path
        )
        for mode in ("raw", "kit")
    }
    # The hazard is real: with a plain forkserver pool the setup runs again in the workers (here the re-run script
    # even tries to start its own pool from inside a worker, which multiprocessing refuses).
    assert run["raw"].stdout.count("SETUP RAN") > 1 or "bootstrapping phase" in run["raw"].stderr
    kit = run["kit"]
    assert kit.returncode == 0, kit.stderr[-2000:]
    assert kit.stdout.count("SETUP RAN") == 1 and "results [3.0, 3.0, 3.0, 3.0]" in kit.stdout


def test_a_huge_exponent_is_no_number():
    """A number like 1e3000000 is no answer, and reading it exactly (Fraction) took seconds, growing with the
    exponent (minutes for 1e99999999) in a reward called directly, outside the worker pool's timeout: it is not read
    as a number."""
    from areal_lite.reward.math_answer import _parse_number

    assert _parse_number("1e3000000") is None and _parse_number("-2.5E+99999999") is None
    assert _parse_number("2.5e3") == 2500 and _parse_number("1e-5") * 100000 == 1  # ordinary exponents still are
    assert answer_reward("The answer is 1e99999999.", "#### 5") == 0.0
    assert math_equal("1e99999999", "1e99999999")  # the same text is still the same answer


def test_a_symbolic_comparison_that_times_out_is_logged(caplog):
    """Scored unequal when it runs out of time (perhaps wrongly): a warning says so, as MathVerifyWorker's does;
    it was a debug line no one sees."""
    with caplog.at_level("WARNING", logger="areal_lite.reward.math_answer"):
        assert not math_equal("\\sin(y)^2+\\cos(y)^2", "1", timeout=0.001)
    assert "math_equal took over 0.001s" in caplog.text and "scored unequal" in caplog.text
    assert math_equal("\\sin(y)^2+\\cos(y)^2", "1", timeout=30)  # the same pair, given the time: equal
