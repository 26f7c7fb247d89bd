"""`AsyncRewardWrapper` (AReaL 1.0.4's `areal.api.reward_api`): `await AsyncRewardWrapper(fn)(*args, **kwargs)` runs a
picklable reward in a worker process with a timeout, so a slow or hanging reward cannot stall the event loop.

Design decisions:
- `AsyncRewardWrapper` (AReaL's name) runs a picklable reward in a `ProcessPoolExecutor` with the
  *forkserver* context (fork is unsafe once the engine's threads run; forkserver forks from a clean
  server that preloads this module, so new workers start in milliseconds). It awaits through
  `loop.run_in_executor` on whatever loop is running, so it works from the notebook's loop and from
  the rollout executor's background-thread loop. A timeout kills the pool's workers (a hung worker
  would otherwise hold its slot forever) and starts a fresh pool; calls caught in the kill, and
  calls hit by a crashed worker (BrokenProcessPool), are retried on the new pool (up to `max_retries` times).
  Functions defined in a notebook or script (`__main__`) cannot be imported by a worker, so they
  are shipped by value with cloudpickle; anything else must pickle by reference (module-level).
- No orphans, whoever dies: each worker exits when the process that started the pool ends (a pidfd watch,
  `utils.lifeline`), SIGKILL included, and when its parent, the forkserver, dies. The forkserver and the resource
  tracker exit by themselves once the workers are gone (the workers hold their pipes open until then).
- Nothing left in /dev/shm either: the pool's named semaphores lose their names as soon as every worker has opened
  them (`_unlink_semaphore_names`), so a kill of the whole process group, resource tracker included (a notebook
  kernel stopped by nbval), leaves none behind.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import logging
import math
import multiprocessing
import os
import pickle
import sys
import threading
import time
import weakref
from concurrent.futures.process import BrokenProcessPool
from typing import Optional

from areal_lite.utils.lifeline import Identity, exit_when_gone, process_identity, set_parent_death_signal

__all__ = ["AsyncRewardWrapper"]

logger = logging.getLogger(__name__)


# ============================================================================ async wrapper
def _worker_init(owner: Optional[Identity] = None):
    import signal

    # Ctrl-C in the notebook interrupts the cell, not the reward workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if owner is None:
        return
    # No orphans when the owner (the trainer, the kernel) dies, SIGKILL included: a worker's parent is the
    # forkserver, not the owner, so it watches the owner itself; it also dies with its parent, the forkserver
    # (single-threaded, so the parent-death signal cannot fire early). Once every worker is gone, the forkserver
    # and the resource tracker see their pipes close and exit on their own.
    if os.getppid() != owner[0]:
        set_parent_death_signal(signal.SIGKILL)
    exit_when_gone(owner)


def _call_by_value(payload: bytes, args, kwargs):
    import cloudpickle  # noqa: F401  (unpickling a cloudpickled function needs it importable)

    return pickle.loads(payload)(*args, **kwargs)


def _call(fn, args, kwargs):
    return fn(*args, **kwargs)


def _needs_by_value(fn) -> bool:
    # A worker cannot import a notebook's (or a script's) __main__ by name.
    return getattr(fn, "__module__", None) == "__main__"


def _mp_context():
    methods = multiprocessing.get_all_start_methods()
    if "forkserver" in methods:
        ctx = multiprocessing.get_context("forkserver")
        # Only takes effect before the forkserver starts; harmless otherwise.
        ctx.set_forkserver_preload(["areal_lite.api.reward_api", "areal_lite.reward.math_answer", "math_verify"])
        return ctx
    return multiprocessing.get_context("spawn")


@contextlib.contextmanager
def _main_script_hidden():
    """Hide the running script from multiprocessing while worker processes start.

    A forkserver or spawn worker is told the path of `__main__` and imports it again, which re-runs every line of a
    script without an `if __name__ == "__main__":` guard (setup, server launches) in every worker. The workers never
    need `__main__`: reward functions defined there travel by value (cloudpickle). Notebooks have no script path.
    """
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main is not None and k in main.__dict__}
    if main is not None and saved.get("__file__"):
        main.__dict__.pop("__file__")
        main.__spec__ = None
    try:
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)


def _start_pool(max_workers: int) -> concurrent.futures.ProcessPoolExecutor:
    """A pool whose workers are all started now, with the script hidden (see `_main_script_hidden`): a worker is
    started inside `submit`, so `max_workers` concurrent short calls start every one of them."""
    pool = concurrent.futures.ProcessPoolExecutor(
        max_workers=max_workers,
        mp_context=_mp_context(),
        initializer=_worker_init,
        initargs=(process_identity(os.getpid()),),
    )
    with _main_script_hidden():
        warmups = [pool.submit(_pid_after, 0.02) for _ in range(max_workers)]
    concurrent.futures.wait(warmups)
    if _every_worker_answered(pool, warmups):
        _unlink_semaphore_names(pool)
    return pool


def _pid_after(delay: float) -> int:
    time.sleep(delay)
    return os.getpid()


def _every_worker_answered(pool: concurrent.futures.ProcessPoolExecutor, calls: list, within: float = 10.0) -> bool:
    """Whether every started worker ran one of `calls` (`_pid_after`; so has unpickled its queues and opened their
    semaphores): a started worker may still be unpickling while another has run all the warm-up calls. Further
    rounds of short calls, one per worker, until each worker's pid came back; False when one has not within
    `within` seconds."""
    seen: set = set()
    deadline = time.monotonic() + within
    try:
        with _main_script_hidden():
            while True:
                seen.update(f.result(timeout=max(0.0, deadline - time.monotonic()) + 1.0) for f in calls)
                if not set(pool._processes) - seen:
                    return True
                if time.monotonic() > deadline:
                    return False
                calls = [pool.submit(_pid_after, 0.02) for _ in pool._processes]
    except Exception:  # a worker that died on start: the first real call finds the pool broken, as before
        return False


def _unlink_semaphore_names(pool: concurrent.futures.ProcessPoolExecutor) -> None:
    """Remove the /dev/shm names of the pool's semaphores (its two queues' locks) once every worker has opened them.

    Why: with forkserver or spawn, multiprocessing keeps each name until the pool is collected, or until the resource
    tracker cleans up after its owner died. A kill of the owner's whole process group (a notebook kernel stopped by
    nbval, or by Jupyter after its grace period) takes the tracker too, and the five names stayed until reboot. Every
    process that needs them has them open by now, and no worker starts later (a broken pool is replaced, not
    refilled), so the names can go, as a fork pool's do at once; the semaphores live on. Best effort: the pool's
    queues are private attributes (stable since Python 3.8); where anything differs, the names stay as they were.
    """
    try:
        import _multiprocessing
        from multiprocessing import resource_tracker, util
        from multiprocessing.synchronize import SemLock

        if len(pool._processes) < pool._max_workers:  # a worker still to start would open the names
            return
        queues = (pool._call_queue, pool._result_queue)
        locks = [getattr(q, a, None) for q in queues for a in ("_rlock", "_wlock", "_sem")]
        names = {lock._semlock.name for lock in locks if lock is not None and lock._semlock.name}
    except Exception as e:  # never worth failing a reward pool over
        logger.debug("reward pool: semaphore names left in place (%s)", e)
        return
    for name in names:
        try:
            _multiprocessing.sem_unlink(name)
            resource_tracker.unregister(name, "semaphore")
            # Its exit-time unlink would now fail on the missing name (a traceback at exit): cancelled.
            for finalizer in list(util._finalizer_registry.values()):
                if finalizer._callback is SemLock._cleanup and finalizer._args == (name,):
                    finalizer.cancel()
        except Exception as e:
            logger.debug("reward pool: semaphore name %s left in place (%s)", name, e)


def _kill_pool(pool: concurrent.futures.ProcessPoolExecutor) -> None:
    """Kill a pool's workers now (a hung reward would keep `shutdown()` waiting forever)."""
    processes = list(getattr(pool, "_processes", {}).values())  # private, but stable since 3.8
    for p in processes:
        try:
            p.kill()
        except Exception:
            pass
    # No cancel_futures: queued calls must fail with BrokenProcessPool (and be retried), not be
    # cancelled, which would look like the caller's own cancellation.
    pool.shutdown(wait=False)
    for p in processes:
        try:
            p.join(timeout=2)
        except Exception:
            pass


_LIVE_WRAPPERS: weakref.WeakSet = weakref.WeakSet()


def _shutdown_all():
    for wrapper in list(_LIVE_WRAPPERS):
        wrapper.shutdown()


# concurrent.futures joins pool workers at exit, which would wait forever on a hung reward. Its hook
# runs from threading's exit hooks, newest first, so registering there (after importing it) lets us
# kill our workers before it waits. atexit stays as the fallback if that private hook is missing.
try:
    threading._register_atexit(_shutdown_all)
except (AttributeError, RuntimeError):
    atexit.register(_shutdown_all)


class AsyncRewardWrapper:
    """`await AsyncRewardWrapper(fn)(*args, **kwargs) -> float`, run in a worker process with a timeout.

    Hangs, crashes and non-numeric results give 0.0, are counted in `.stats` and logged. AReaL 1.0.4's constructor;
    its behaviour differs on purpose: AReaL retries a timed-out call `max_retries` times and re-raises the reward's
    exception on the last try (one crashing reward then fails the whole rollout). The kit scores a hang or a crash
    0.0 at once -- a retry of a hanging reward only waits again -- and uses `max_retries` for a worker pool that
    died (it is rebuilt and the call tried again). `max_workers=None`: up to 2 worker processes.
    """

    def __init__(self, reward_fn, timeout_seconds: float = 15, max_workers: int | None = None, max_retries: int = 3):
        if not callable(reward_fn):
            raise TypeError(f"reward_fn must be callable, got {type(reward_fn).__name__}")
        if max_workers is None:
            max_workers = max(1, min(2, os.cpu_count() or 1))
        if timeout_seconds <= 0 or max_workers < 1 or max_retries < 0:
            raise ValueError("timeout_seconds must be > 0, max_workers >= 1 and max_retries >= 0")
        self.reward_fn = reward_fn
        self.timeout_seconds = float(timeout_seconds)
        self.max_workers = int(max_workers)
        self.max_retries = int(max_retries)
        self._payload = None
        if _needs_by_value(reward_fn):
            try:
                import cloudpickle
            except ImportError as e:
                raise TypeError(
                    "reward functions defined in a notebook need `cloudpickle` to reach worker "
                    "processes; install it or define the function in a module"
                ) from e
            self._payload = cloudpickle.dumps(reward_fn)
        else:
            try:
                pickle.dumps(reward_fn)
            except Exception as e:
                raise TypeError(f"reward_fn must be picklable to run in a worker process: {e}") from e
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._closed = False
        self._stats = {"calls": 0, "timeouts": 0, "errors": 0, "pool_restarts": 0}
        _LIVE_WRAPPERS.add(self)

    # -- pool management
    def _get_pool(self):
        with self._lock:
            if self._closed:
                raise RuntimeError("AsyncRewardWrapper has been shut down")
            if self._pool is None:
                self._pool = _start_pool(self.max_workers)
            return self._pool

    async def _ready_pool(self):
        """The pool; a missing one is started on a thread, since starting workers takes a second or more and the
        event loop (the rollout's) must keep serving meanwhile."""
        pool = self._pool
        return pool if pool is not None and not self._closed else await asyncio.to_thread(self._get_pool)

    def _replace_pool(self, pool) -> None:
        """Kill `pool` (if still current) so the next call gets a fresh one."""
        with self._lock:
            if self._pool is not pool:
                return  # someone else already replaced it
            self._pool = None
            self._stats["pool_restarts"] += 1
        _kill_pool(pool)

    def _count(self, key: str) -> None:
        with self._lock:
            self._stats[key] += 1

    @property
    def stats(self) -> dict:
        with self._lock:
            return dict(self._stats)

    # -- calling
    async def __call__(self, *args, **kwargs) -> float:
        self._count("calls")
        loop = asyncio.get_running_loop()
        if self._payload is not None:
            job = (_call_by_value, self._payload, args, kwargs)
        else:
            job = (_call, self.reward_fn, args, kwargs)
        # The timeout is the reward's: it counts time spent waiting on the call, not the start of a fresh pool
        # (after a crash or a hang killed the last one), which would otherwise eat the next call's budget.
        budget = self.timeout_seconds
        name = getattr(self.reward_fn, "__name__", repr(self.reward_fn))
        for attempt in range(self.max_retries + 1):
            pool = await self._ready_pool()
            started = time.monotonic()
            try:
                fut = loop.run_in_executor(pool, *job)
                result = await asyncio.wait_for(fut, timeout=max(budget, 0.01))
            except asyncio.TimeoutError:
                self._count("timeouts")
                logger.warning("reward %s timed out after %.1f s; scoring 0.0", name, self.timeout_seconds)
                self._replace_pool(pool)
                return 0.0
            except BrokenProcessPool:
                # A worker died (crash, or killed because another call hung); retry once.
                self._replace_pool(pool)
                budget -= time.monotonic() - started
                if attempt < self.max_retries and budget > 0:
                    continue
                self._count("errors")
                logger.warning("reward %s: worker process died; scoring 0.0", name)
                return 0.0
            except asyncio.CancelledError:
                # Our own cancellation propagates; a future cancelled by a pool kill is a broken pool.
                task = asyncio.current_task()
                if (task is not None and task.cancelling()) or attempt == self.max_retries:
                    raise
                self._replace_pool(pool)
                continue
            except (Exception, SystemExit, KeyboardInterrupt) as e:  # a reward's sys.exit() comes back as SystemExit
                self._count("errors")
                logger.warning("reward %s raised %s: %s; scoring 0.0", name, type(e).__name__, e)
                return 0.0
            return self._as_reward(result, name)
        return 0.0  # max_retries pool restarts were all cancelled

    def _as_reward(self, result, name: str) -> float:
        try:
            if isinstance(result, (str, bytes)):
                raise TypeError("a string")
            value = float(result)
            if not math.isfinite(value):
                raise ValueError("not finite")
            return value
        except Exception as e:  # float() of any object: 10**400 overflows, a __float__ may raise anything
            self._count("errors")
            logger.warning("reward %s returned %r (%s), not a number; scoring 0.0", name, result, e)
            return 0.0

    def start_workers(self) -> threading.Thread:
        """Start the worker processes on a thread and return at once (kit extra; join the thread to wait).

        Starting them takes seconds on a 2-core machine; started while a server loads its model, they are running by
        the first call, which would otherwise pay for them inside its rollout (the first held-out evaluation)."""

        def start() -> None:
            with contextlib.suppress(RuntimeError):  # shut down before it started: nothing to do
                self._get_pool()

        thread = threading.Thread(target=start, name="reward-workers", daemon=True)
        thread.start()
        return thread

    async def warmup(self) -> None:
        """Start all workers now, so the first real calls don't pay process start-up inside their timeout."""
        loop = asyncio.get_running_loop()
        pool = await self._ready_pool()
        await asyncio.gather(*[loop.run_in_executor(pool, time.sleep, 0.05) for _ in range(self.max_workers)])

    def shutdown(self) -> None:
        """Stop the worker processes. Idempotent."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            _kill_pool(pool)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
