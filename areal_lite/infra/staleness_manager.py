"""The staleness bound: `StalenessManager` holds the rollout counters and the one rule that says how many episodes
may start now (AReaL 1.0.4's `areal.infra.staleness_manager`). New asynchronous episodes start while

    capacity = min(max_concurrent_rollouts - running, (eta + v - v0 + 1) * B - (accepted + running)) > 0

v = current version, B = consumer_batch_size, eta = max_head_offpolicyness; `accepted` counts every accepted
asynchronous episode so far, consumed or not; `running` counts every running episode in the first term and the
asynchronous ones in the second (`rollout_batch` episodes are outside the bound). `max_concurrent_rollouts=None`
means B, as in AReaL. `queue_size`, when set, also stops new starts once unconsumed results + running episodes
reach it (backpressure). v0 is the version at which the first episode started: 0 in a fresh run, so the rule is
AReaL's exactly; a run resumed at version k would otherwise start (k + 1) * B episodes at once, all k versions stale
by the time they are consumed.

Pure methods (`bound`, `headroom`, `capacity`) and `explain()`, which says in words what the bound is and why, so
a notebook can print it and a test can check it with hand-built numbers and no server. The executor
(`areal_lite.infra.workflow_executor`) reads and updates the counters under its lock.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["StalenessManager"]

# ------------------------------------------------------------------------------------------------ the staleness rule


class StalenessManager:
    """The counters of the staleness bound and the rule computed from them (see the module docstring).

    Not locked itself: the executor reads and updates it under its Condition. `running` and `accepted` count
    asynchronous episodes (submit/prepare_batch) only; `sync_running` counts rollout_batch episodes, which use a
    concurrency slot but are outside the bound.
    """

    def __init__(
        self,
        consumer_batch_size: int,
        max_head_offpolicyness: int,
        max_concurrent_rollouts: Optional[int] = None,
        queue_size: Optional[int] = None,
    ):
        if consumer_batch_size < 1:
            raise ValueError(f"consumer_batch_size must be >= 1, got {consumer_batch_size}")
        if max_head_offpolicyness < 0:
            raise ValueError(f"max_head_offpolicyness must be >= 0, got {max_head_offpolicyness}")
        if max_concurrent_rollouts is not None and max_concurrent_rollouts < 1:
            raise ValueError(f"max_concurrent_rollouts must be >= 1 or None, got {max_concurrent_rollouts}")
        if queue_size is not None and queue_size < 1:
            raise ValueError(f"queue_size must be >= 1 or None, got {queue_size}")
        self.consumer_batch_size = consumer_batch_size
        self.max_head_offpolicyness = max_head_offpolicyness
        self.max_concurrent_rollouts = max_concurrent_rollouts or consumer_batch_size
        self.queue_size = queue_size
        self.version = 0
        self.base_version: Optional[int] = None  # v0: the version when the first asynchronous episode started
        self.accepted = 0  # asynchronous episodes accepted so far, consumed or not
        self.running = 0  # asynchronous episodes running
        self.sync_running = 0  # rollout_batch episodes running
        self.ready = 0  # accepted, not yet consumed

    @classmethod
    def from_config(cls, config: Any) -> "StalenessManager":
        """From an `InferenceEngineConfig` (or anything with its four fields)."""
        return cls(
            config.consumer_batch_size,
            config.max_head_offpolicyness,
            config.max_concurrent_rollouts,
            config.queue_size,
        )

    # ---------------------------------------------------------------------------------- the rule (pure)

    @property
    def first_version(self) -> int:
        """v0; before any episode started, the current version (counting would start now)."""
        return self.version if self.base_version is None else self.base_version

    def bound(self) -> int:
        """(eta + v - v0 + 1) * B: how many episodes may have been accepted or be running by version v."""
        return (self.max_head_offpolicyness + self.version - self.first_version + 1) * self.consumer_batch_size

    def headroom(self) -> int:
        """Episodes the staleness bound still allows to start at the current version (may be negative)."""
        return self.bound() - (self.accepted + self.running)

    def free_slots(self) -> int:
        """Concurrency slots left: every running episode, synchronous or not, holds one."""
        return self.max_concurrent_rollouts - (self.running + self.sync_running)

    def queue_room(self) -> Optional[int]:
        """With `queue_size`: results it still has room for (unconsumed + running count); None: unbounded."""
        if self.queue_size is None:
            return None
        return self.queue_size - (self.ready + self.running + self.sync_running)

    def capacity(self) -> int:
        """How many more asynchronous episodes may start now: the smallest of the three limits."""
        cap = min(self.free_slots(), self.headroom())
        room = self.queue_room()
        return cap if room is None else min(cap, room)

    def bound_text(self) -> str:
        eta, v, v0, B = self.max_head_offpolicyness, self.version, self.first_version, self.consumer_batch_size
        return f"(eta + v - v0 + 1) * B = ({eta} + {v} - {v0} + 1) * {B} = {self.bound()}"

    def explain(self) -> str:
        """The current bound and why, in words, with the numbers (for a notebook to print)."""
        eta, v, v0, B = self.max_head_offpolicyness, self.version, self.first_version, self.consumer_batch_size
        since = "" if self.base_version is not None else " (no episode started yet: counting starts at this version)"
        if eta == 0:
            mode = "synchronous: every episode is consumed at the version it started at"
        else:
            mode = f"an episode may be consumed up to {eta} version(s) after the one it started at"
        lines = [
            f"version {v}, counted from v0={v0}{since}; eta={eta} ({mode}); B={B}.",
            f"Staleness bound: at most {self.bound_text()} episodes may be accepted or running by now; "
            f"{self.accepted} accepted + {self.running} running -> {max(self.headroom(), 0)} more may start.",
            f"Concurrency: {self.running + self.sync_running} of max_concurrent_rollouts={self.max_concurrent_rollouts}"
            f" running ({self.sync_running} of them rollout_batch episodes, outside the bound) -> "
            f"{max(self.free_slots(), 0)} more.",
        ]
        room = self.queue_room()
        if room is not None:
            lines.append(
                f"Backpressure: queue_size={self.queue_size}, {self.ready} results waiting to be consumed + "
                f"{self.running + self.sync_running} running -> {max(room, 0)} more."
            )
        lines.append(f"So {max(self.capacity(), 0)} more episode(s) may start now ({self._limit()}).")
        return "\n".join(lines)

    def _limit(self) -> str:
        """Which limit decides the capacity, in words (with what lifts it when nothing may start)."""
        limits = {"the staleness bound": self.headroom(), "the concurrency limit": self.free_slots()}
        if self.queue_size is not None:
            limits["queue_size"] = self.queue_room()
        low = min(limits.values())
        deciding = [name for name, value in limits.items() if value == low]
        if low > 0:
            return " and ".join(deciding) + (" decides" if len(deciding) == 1 else " decide")
        lifts = {
            "the staleness bound": f"call set_version({self.version + 1}) after the next training step",
            "the concurrency limit": "running episodes must finish first",
            "queue_size": "finished results must be consumed first",
        }
        return "; ".join(f"{name} is reached: {lifts[name]}" for name in deciding)

    # ---------------------------------------------------------------------------------- events

    def on_started(self, synchronous: bool) -> None:
        if synchronous:
            self.sync_running += 1
            return
        if self.base_version is None:
            self.base_version = self.version
        self.running += 1

    def on_finished(self, synchronous: bool, accepted: bool) -> None:
        if synchronous:
            self.sync_running -= 1
            return
        self.running -= 1
        if accepted:
            self.accepted += 1
            self.ready += 1

    def on_consumed(self, count: int) -> None:
        self.ready -= count
