"""The kit's `StalenessManager` against AReaL 1.0.4's on the same inputs: the constructor, the counters through the
lifecycle callbacks, and the capacity numbers on a grid of settings, including a recovered (resumed) run.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools

import pytest

from areal_lite.infra.staleness_manager import RolloutStat, StalenessManager, VersionCounter


@pytest.fixture
def areal_sm(import_areal):
    """AReaL 1.0.4's `areal.infra.staleness_manager`. A fixture, not `pytest.importorskip`: AReaL is installed
    --no-deps, and a dependency it lacks must fail this conformance test (with the import error), not skip it;
    `import_areal` (conftest) also undoes the OPENAI_* variables AReaL sets at import."""
    return import_areal("areal.infra.staleness_manager")


def _pair(areal_sm, mc, B, eta, version=0):
    """(AReaL's manager, the kit's) on one version provider; `areal_sm` is the fixture's module."""
    provider = VersionCounter(version)
    return [cls(provider, mc, B, eta) for cls in (areal_sm.StalenessManager, StalenessManager)]


def _drive(manager, accepted, running, rejected, enqueued):
    """Reach the counters through AReaL's callbacks, in its order (enqueue -> submit -> accept/reject)."""
    for _ in range(accepted + running + rejected + enqueued):
        manager.on_rollout_enqueued()
    for _ in range(accepted + running + rejected):
        manager.on_rollout_submitted()
    for _ in range(accepted):
        manager.on_rollout_accepted()
    for _ in range(rejected):
        manager.on_rollout_rejected()


def test_constructor_is_areals(areal_sm, import_areal):
    theirs = list(inspect.signature(areal_sm.StalenessManager.__init__).parameters.values())
    ours = list(inspect.signature(StalenessManager.__init__).parameters.values())
    assert [(p.name, p.kind, p.default) for p in ours[: len(theirs)]] == [(p.name, p.kind, p.default) for p in theirs]
    assert all(p.kind is p.KEYWORD_ONLY and p.default is not p.empty for p in ours[len(theirs) :])  # kit extras
    AReaLRolloutStat = import_areal("areal.api.io_struct").RolloutStat

    fields = lambda cls: [(f.name, f.default) for f in dataclasses.fields(cls)]  # noqa: E731
    assert fields(RolloutStat) == fields(AReaLRolloutStat)
    theirs_sm, ours_sm = _pair(areal_sm, 10, 4, 2)
    for name in ("version_provider", "max_concurrent_rollouts", "consumer_batch_size", "max_staleness"):
        assert getattr(ours_sm, name) == getattr(theirs_sm, name), name


GRID = list(
    itertools.product(
        (0, 1, 4, 9),  # max_concurrent_rollouts (0 counts as 1 in both)
        (0, 1, 3),  # consumer_batch_size (0 counts as 1 in both)
        (0, 2),  # max_staleness
        (0, 1, 5),  # version
    )
)


@pytest.mark.parametrize("mc,B,eta,version", GRID)
def test_capacity_and_stats_equal_areals(mc, B, eta, version, areal_sm):
    for accepted, running, rejected, enqueued in itertools.product((0, 4), (0, 3), (0, 2), (0, 1)):
        theirs, ours = _pair(areal_sm, mc, B, eta, version)
        for m in (theirs, ours):
            _drive(m, accepted, running, rejected, enqueued)
        case = (mc, B, eta, version, accepted, running, rejected, enqueued)
        assert ours.get_capacity() == theirs.get_capacity(), case
        assert isinstance(ours.get_capacity(), int)
        assert dataclasses.asdict(ours.get_stats()) == dataclasses.asdict(theirs.get_stats()), case
        assert ours.get_pending_limit() == theirs.get_pending_limit(), case
        ours.version_provider.set_version(version + 1)  # one provider: both see the new version
        assert ours.get_capacity() == theirs.get_capacity(), case


@pytest.mark.parametrize("recovered", [0, 3, 10])
def test_a_recovered_run_equals_areals(recovered, areal_sm):
    theirs, ours = _pair(areal_sm, 64, 4, 1, version=recovered)
    for m in (theirs, ours):
        m.on_version_recovered(recovered)
    assert ours.get_capacity() == theirs.get_capacity() == (1 + 1) * 4  # not (1 + recovered + 1) * 4
    for step in range(3):
        for m in (theirs, ours):
            _drive(m, accepted=4, running=0, rejected=1, enqueued=0)
        ours.version_provider.set_version(recovered + step + 1)
        assert ours.get_capacity() == theirs.get_capacity()
        assert dataclasses.asdict(ours.get_stats()) == dataclasses.asdict(theirs.get_stats())


def test_the_kit_extras_change_nothing_when_unused(areal_sm):
    """`rollout_batch` episodes (outside the bound) and `queue_size` are the kit's; without them, AReaL's number."""
    provider = VersionCounter(2)
    theirs = areal_sm.StalenessManager(provider, 8, 2, 1)
    ours = StalenessManager(provider, 8, 2, 1, queue_size=None)
    for m in (theirs, ours):
        _drive(m, accepted=3, running=2, rejected=0, enqueued=0)
    assert ours.capacity() == ours.get_capacity() == theirs.get_capacity()
    ours.on_started(synchronous=True)  # holds a slot, not a place under the bound
    assert ours.free_slots() == 8 - 3 and ours.headroom() == (1 + 2 + 1) * 2 - 5 == 3
    assert ours.get_capacity() == theirs.get_capacity() == 3 and ours.get_stats().running == 2
