"""An asyncio event loop on a daemon thread, which a garbage-collected owner releases.

    runner = LoopThread("areal-lite-rollout")          # runner.loop runs on runner.thread
    finalizer = runner.release_with(owner, cleanup)    # owner collected: await cleanup(), stop and close the loop

Design decisions
- The thread holds the loop, never its owner (the engine, the chat server): an owner dropped without its own
  teardown (a notebook cell run again makes a new one) can be collected, and its finalizer ends the thread, which
  would otherwise idle for the rest of the kernel's life.
- The release waits for nothing: the garbage collector may run it on the loop's own thread.
- The owner's orderly teardown detaches the finalizer first; at interpreter exit none runs (the daemon thread ends).
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from typing import Any, Awaitable, Callable


class LoopThread:
    """A new event loop, running on a started daemon thread named `name` (`loop`, `thread`)."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._released = threading.Event()
        started = threading.Event()
        self.thread = threading.Thread(target=_run, args=(self.loop, started, self._released), name=name, daemon=True)
        self.thread.start()
        started.wait()

    def release_with(self, owner: Any, cleanup: Callable[[], Awaitable[None]]) -> weakref.finalize:
        """When `owner` is collected: `await cleanup()` on the loop, then stop and close it. `cleanup` must not refer
        to `owner` (it would never be collected). Returns the finalizer, for the owner's teardown to `detach()`."""
        finalizer = weakref.finalize(owner, _release, self.loop, self.thread, self._released, cleanup)
        finalizer.atexit = False
        return finalizer


def _run(loop: asyncio.AbstractEventLoop, started: threading.Event, released: threading.Event) -> None:
    asyncio.set_event_loop(loop)
    loop.call_soon(started.set)
    loop.run_forever()
    if released.is_set():  # stopped by `_release`: nobody else will close the loop
        loop.close()


def _release(loop, thread: threading.Thread, released: threading.Event, cleanup: Callable[[], Awaitable[None]]):
    if loop.is_closed() or not thread.is_alive():
        return

    async def release() -> None:
        try:
            await cleanup()
        finally:
            loop.stop()

    released.set()
    asyncio.run_coroutine_threadsafe(release(), loop)
