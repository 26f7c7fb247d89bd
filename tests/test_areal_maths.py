"""The kit's advantage normalisation against AReaL 1.0.4's own `areal.utils.data.Normalization`, on random batches,
for every mean/std level, leave-one-out and unbiased setting (1e-6), and the constant group that used to blow up.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from areal_lite.actor import normalize
from areal_lite.config import NormConfig

LEVELS = ["batch", "group", "none"]
SETTINGS = [
    (mean, std, loo, unbiased)
    for mean, std, loo, unbiased in itertools.product(LEVELS, LEVELS, [False, True], [True, False])
    if not (loo and mean == "none")
]


def areal_normalize(x, cfg: NormConfig):
    from areal.api.cli_args import NormConfig as AReaLNormConfig
    from areal.utils.data import Normalization

    level = {"none": None}
    areal_cfg = AReaLNormConfig(mean_level=level.get(cfg.mean_level, cfg.mean_level),
                                std_level=level.get(cfg.std_level, cfg.std_level), mean_leave1out=cfg.mean_leave1out,
                                std_unbiased=cfg.std_unbiased, eps=cfg.eps, group_size=cfg.group_size)
    return Normalization(areal_cfg)(x.clone())


@pytest.mark.parametrize("mean,std,loo,unbiased", SETTINGS)
@pytest.mark.parametrize("seed", [0, 1])
def test_normalisation_equals_areals(mean, std, loo, unbiased, seed):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 3, (12,), generator=g).float() / 2  # ties and constant groups happen
    cfg = NormConfig(mean_level=mean, std_level=std, mean_leave1out=loo, std_unbiased=unbiased, group_size=4)
    ours = normalize(rewards, torch.ones(12, dtype=torch.bool), cfg)
    torch.testing.assert_close(ours, areal_normalize(rewards, cfg), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("mean", ["none", "group", "batch"])
def test_a_constant_group_gives_finite_advantages(mean):
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    cfg = NormConfig(mean_level=mean, std_level="group", group_size=4)
    out = normalize(rewards, torch.ones(8, dtype=torch.bool), cfg)
    assert out.abs().max() < 10, out  # it was 1e5 = 1 / eps with mean_level "none"
    torch.testing.assert_close(out, areal_normalize(rewards, cfg), atol=1e-6, rtol=1e-6)
