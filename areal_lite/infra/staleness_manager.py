"""The staleness bound: `StalenessManager` holds the rollout counters and the one rule that says how many episodes
may start now (AReaL 1.0.4's `areal.infra.staleness_manager`, same constructor, methods and numbers). New
asynchronous episodes start while

    capacity = min(max_concurrent_rollouts - running, (eta + v + 1) * B - (accepted + running)) > 0

v = the version provider's `get_version()`, B = consumer_batch_size, eta = max_staleness; `accepted` counts every
accepted asynchronous episode so far, consumed or not. A run resumed at version k calls `on_version_recovered(k)`,
which counts k * B episodes as accepted: the bound is then (eta + 1) * B, not (eta + k + 1) * B episodes at once,
all k versions stale. The kit's executor does that itself on a `set_version` before its first episode.

Kit extras, neutral when unused: `rollout_batch` episodes (`sync_running`) hold a concurrency slot but stay outside
the bound; `queue_size` stops new starts once unconsumed results + running episodes reach it (backpressure).
`explain()` says in words what the bound is and why, written as (eta + v - v0 + 1) * B with v0 the recovered
version, so a notebook can print it and a test can check it with hand-built numbers and no server.
"""

from __future__ import annotations

import threading
from typing import Any, Optional, Protocol

from areal_lite.api.io_struct import RolloutStat

__all__ = ["RolloutStat", "StalenessManager", "VersionCounter", "VersionProvider"]


class VersionProvider(Protocol):
    def get_version(self) -> int: ...


class VersionCounter:
    """A version provider that is just a number (what the kit's executor sets after each training step)."""

    def __init__(self, version: int = 0):
        self._version = int(version)

    def get_version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        self._version = int(version)


class StalenessManager:
    """The counters of the staleness bound and the rule computed from them (see the module docstring).

    Every method takes the manager's own lock (AReaL's), so any thread may call it; the kit's executor also calls
    it under its Condition. `max_concurrent_rollouts` and `consumer_batch_size` count as at least 1.
    """

    def __init__(
        self,
        version_provider: VersionProvider,
        max_concurrent_rollouts: int,
        consumer_batch_size: int,
        max_staleness: int,
        *,
        queue_size: Optional[int] = None,
    ):
        self.version_provider = version_provider
        self.max_concurrent_rollouts = max_concurrent_rollouts
        self.consumer_batch_size = consumer_batch_size
        self.max_staleness = max_staleness
        self.queue_size = queue_size
        self.lock = threading.RLock()  # reentrant: the kit's helpers call the AReaL methods while holding it
        self.rollout_stat = RolloutStat()
        self.base_version: Optional[int] = None  # v0: the version given to on_version_recovered
        self.sync_running = 0  # rollout_batch episodes running
        self.ready = 0  # accepted, not yet consumed

    @classmethod
    def from_config(cls, config: Any, version_provider: Optional[VersionProvider] = None) -> "StalenessManager":
        """From an `InferenceEngineConfig` (or anything with its four fields), checked; `max_concurrent_rollouts`
        None means B, as in AReaL's executor. Without a provider the version is a `VersionCounter`."""
        B, eta = config.consumer_batch_size, config.max_head_offpolicyness
        mc, qs = config.max_concurrent_rollouts, config.queue_size
        if B < 1:
            raise ValueError(f"consumer_batch_size must be >= 1, got {B}")
        if eta < 0:
            raise ValueError(f"max_head_offpolicyness must be >= 0, got {eta}")
        if mc is not None and mc < 1:
            raise ValueError(f"max_concurrent_rollouts must be >= 1 or None, got {mc}")
        if qs is not None and qs < 1:
            raise ValueError(f"queue_size must be >= 1 or None, got {qs}")
        provider = VersionCounter() if version_provider is None else version_provider
        return cls(provider, mc or B, B, eta, queue_size=qs)

    # ---------------------------------------------------------------------------------- counters

    @property
    def version(self) -> int:
        return self.version_provider.get_version()

    @version.setter
    def version(self, value: int) -> None:
        self.version_provider.set_version(int(value))

    @property
    def max_head_offpolicyness(self) -> int:
        """The kit's (and the config's) name for `max_staleness`."""
        return self.max_staleness

    @property
    def accepted(self) -> int:
        return self.rollout_stat.accepted

    @accepted.setter
    def accepted(self, value: int) -> None:
        self.rollout_stat.accepted = value

    @property
    def running(self) -> int:
        return self.rollout_stat.running

    @running.setter
    def running(self, value: int) -> None:
        self.rollout_stat.running = value

    def get_stats(self) -> RolloutStat:
        """A snapshot of the counters."""
        with self.lock:
            s = self.rollout_stat
            return RolloutStat(accepted=s.accepted, enqueued=s.enqueued, rejected=s.rejected, running=s.running)

    # ---------------------------------------------------------------------------------- the rule

    def get_pending_limit(self) -> int:
        """(eta + 1) * B: the episodes one version may have enqueued."""
        return (self.max_staleness + 1) * self.consumer_batch_size

    def _batch(self) -> int:
        return max(1, self.consumer_batch_size)

    @property
    def first_version(self) -> int:
        """v0: the recovered version, 0 in a fresh run."""
        return 0 if self.base_version is None else self.base_version

    def bound(self) -> int:
        """(eta + v - v0 + 1) * B: how many episodes may have been accepted or be running since v0."""
        return (self.max_staleness + self.version - self.first_version + 1) * self._batch()

    def accepted_since_recovery(self) -> int:
        """Accepted episodes since v0 (`accepted` minus the v0 * B that `on_version_recovered` counted)."""
        return self.accepted - self.first_version * self._batch()

    def headroom(self) -> int:
        """Episodes the staleness bound still allows to start: (eta + v + 1) * B - (accepted + running)."""
        with self.lock:
            return (self.max_staleness + self.version + 1) * self._batch() - (self.accepted + self.running)

    def free_slots(self) -> int:
        """Concurrency slots left: every running episode, rollout_batch ones included, holds one."""
        return max(1, self.max_concurrent_rollouts) - (self.running + self.sync_running)

    def queue_room(self) -> Optional[int]:
        """With `queue_size`: results it still has room for (unconsumed + running count); None: unbounded."""
        if self.queue_size is None:
            return None
        return self.queue_size - (self.ready + self.running + self.sync_running)

    def get_capacity(self) -> int:
        """How many more asynchronous episodes may start now (negative when over): the smallest limit."""
        with self.lock:
            cap = min(self.free_slots(), self.headroom())
            room = self.queue_room()
            return cap if room is None else min(cap, room)

    def capacity(self) -> int:
        """The kit's name for `get_capacity`."""
        return self.get_capacity()

    # ---------------------------------------------------------------------------------- events (AReaL's)

    def on_version_recovered(self, version: int) -> None:
        """A run resumed at `version`: count version * B episodes as accepted, so the bound is (eta + 1) * B."""
        with self.lock:
            self.base_version = int(version)
            self.rollout_stat.accepted = int(version) * self._batch()

    def on_rollout_enqueued(self) -> None:
        with self.lock:
            self.rollout_stat.enqueued += 1

    def on_rollout_submitted(self) -> None:
        with self.lock:
            self.rollout_stat.enqueued -= 1
            self.rollout_stat.running += 1

    def on_rollout_accepted(self) -> None:
        with self.lock:
            self.rollout_stat.running -= 1
            self.rollout_stat.accepted += 1

    def on_rollout_rejected(self) -> None:
        with self.lock:
            self.rollout_stat.running -= 1
            self.rollout_stat.rejected += 1

    # ---------------------------------------------------------------------------------- events (the kit's)

    def on_started(self, synchronous: bool) -> None:
        """An episode started; an asynchronous one was enqueued first (`on_rollout_enqueued`)."""
        with self.lock:
            if synchronous:
                self.sync_running += 1
            else:
                self.on_rollout_submitted()

    def on_finished(self, synchronous: bool, accepted: bool) -> None:
        """An episode ended: accepted, or rejected/failed/cancelled (`accepted=False`)."""
        with self.lock:
            if synchronous:
                self.sync_running -= 1
            elif accepted:
                self.on_rollout_accepted()
                self.ready += 1
            else:
                self.on_rollout_rejected()

    def on_consumed(self, count: int) -> None:
        with self.lock:
            self.ready -= count

    # ---------------------------------------------------------------------------------- in words

    def bound_text(self) -> str:
        eta, v, v0, B = self.max_staleness, self.version, self.first_version, self._batch()
        return f"(eta + v - v0 + 1) * B = ({eta} + {v} - {v0} + 1) * {B} = {self.bound()}"

    def explain(self) -> str:
        """The current bound and why, in words, with the numbers (for a notebook to print)."""
        with self.lock:
            return self._explain_locked()

    def _explain_locked(self) -> str:
        eta, v, v0, B = self.max_staleness, self.version, self.first_version, self._batch()
        since = " (the run resumed there)" if self.base_version else " (a fresh run)"
        if eta == 0:
            mode = "synchronous: every episode is consumed at the version it started at"
        else:
            mode = f"an episode may be consumed up to {eta} version(s) after the one it started at"
        mc = max(1, self.max_concurrent_rollouts)
        lines = [
            f"version {v}, counted from v0={v0}{since}; eta={eta} ({mode}); B={B}.",
            f"Staleness bound: at most {self.bound_text()} episodes may be accepted or running by now; "
            f"{self.accepted_since_recovery()} accepted + {self.running} running -> "
            f"{max(self.headroom(), 0)} more may start.",
            f"Concurrency: {self.running + self.sync_running} of max_concurrent_rollouts={mc}"
            f" running ({self.sync_running} of them rollout_batch episodes, outside the bound) -> "
            f"{max(self.free_slots(), 0)} more.",
        ]
        room = self.queue_room()
        if room is not None:
            lines.append(
                f"Backpressure: queue_size={self.queue_size}, {self.ready} results waiting to be consumed + "
                f"{self.running + self.sync_running} running -> {max(room, 0)} more."
            )
        lines.append(f"So {max(self.get_capacity(), 0)} more episode(s) may start now ({self._limit()}).")
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
