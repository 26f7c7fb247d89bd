"""areal_lite.utils.functional: the formulas that `tests/test_actor.py` does not already check through the actor.

Pure tensor functions, so every check here is a small float64 example worked by hand or by a loop.
(`normalize`, `kl_estimate`, `ppo_token_loss`, `grpo_advantages` are checked in test_actor.py against loops, and in
test_areal_maths.py against AReaL 1.0.4.)
"""

from __future__ import annotations

import math

import pytest
import torch

from areal_lite.api.cli_args import NormConfig
from areal_lite.utils import functional as fn


def test_next_token_logp_is_the_shift_and_scatter_agrees():
    g = torch.Generator().manual_seed(0)
    T, V = 7, 11
    logits = torch.randn(T, V, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V, (T,), generator=g)
    seq_start = torch.tensor([1, 0, 0, 0, 1, 0, 0], dtype=torch.bool)  # two packed sequences
    lp = fn.next_token_logp(logits, ids, seq_start, temperature=0.5)
    for t in range(T):
        want = 0.0 if seq_start[t] else float(torch.log_softmax(logits[t - 1] / 0.5, -1)[ids[t]])
        assert float(lp[t]) == pytest.approx(want, abs=1e-12)
    pred = torch.tensor([1, 2, 5])  # logits only at the positions that predict tokens 2, 3 and 6
    got = fn.scatter_next_token_logp(logits[pred], ids, pred, temperature=0.5)
    keep = torch.zeros(T, dtype=torch.bool)
    keep[pred + 1] = True
    torch.testing.assert_close(got, torch.where(keep, lp, torch.zeros(())))
    # the update's one-pass version: the same log-probs (and gradient), and each row's entropy
    rows = logits[pred].clone().requires_grad_(True)
    both, ent = fn.scatter_logp_and_entropy(rows, ids, pred, temperature=0.5)
    torch.testing.assert_close(both, got)
    torch.testing.assert_close(ent.float(), fn.entropy(logits[pred], 0.5))
    assert not ent.requires_grad
    (grad,) = torch.autograd.grad(both.sum(), rows)
    ref = logits[pred].clone().requires_grad_(True)
    (want,) = torch.autograd.grad(fn.scatter_next_token_logp(ref, ids, pred, 0.5).sum(), ref)
    torch.testing.assert_close(grad, want)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logp_and_entropy_are_the_whole_tensor_formula_bit_for_bit(dtype, device):
    """`scatter_logp_and_entropy` goes a few rows at a time on a CPU and over all rows on a GPU (`_LogpEntropy`);
    its log-probs, entropies and gradient must be those of the formula written on the whole tensor with autograd,
    bit for bit: row counts that are not a multiple of the CPU's pass, a vocabulary the size of a real one, float32
    and bf16 (autocast's) logits."""
    g = torch.Generator().manual_seed(1)
    K, V, T = 2 * fn._LogpEntropy.CPU_ROWS + 5, 49152, 0.8
    logits = (torch.randn(K, V, generator=g) * 3).to(dtype).to(device)
    ids = torch.randint(0, V, (K + 3,), generator=g).to(device)
    pred = torch.arange(1, K + 1, device=device)
    weights = torch.randn(K + 3, generator=g).to(device)

    def whole(x):  # the formula on the whole tensor, autograd's gradient
        logp_all = (x.to(torch.float32) / T).log_softmax(-1)
        lp = logp_all.gather(-1, ids[pred + 1].unsqueeze(-1)).squeeze(-1)
        ent = -(logp_all.exp() * logp_all).sum(-1).detach()
        return lp.new_zeros(K + 3).index_put((pred + 1,), lp), ent

    results = []
    for f in (lambda x: fn.scatter_logp_and_entropy(x, ids, pred, T), whole):
        x = logits.clone().requires_grad_(True)
        lp, ent = f(x)
        (lp * weights).sum().backward()
        results.append((lp.detach(), ent, x.grad))
    for got, want in zip(*results):
        assert got.dtype == want.dtype and torch.equal(got, want)
    x = logits[:0].clone().requires_grad_(True)  # no policy token: zeros, no entropy, a gradient of nothing
    empty = fn.scatter_logp_and_entropy(x, ids, pred[:0], T)
    empty[0].sum().backward()
    assert empty[0].tolist() == [0.0] * (K + 3) and empty[1].numel() == 0 and x.grad.shape == (0, V)


def test_entropy_of_uniform_and_one_hot():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, -1e4, -1e4, -1e4]])
    torch.testing.assert_close(fn.entropy(logits, 1.0), torch.tensor([math.log(4), 0.0]))


def test_kl_rewards_only_on_policy_tokens_and_clamped():
    old = torch.tensor([[-1.0, -2.0, -30.0, 5.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -1.0, -0.5, 99.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False]])
    got = fn.kl_rewards(old, ref, mask, kl_ctl=0.5, estimator="k1")
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch.tensor([[-0.25, 0.5, 0.5 * fn.KL_CLAMP, 0.0]]))
    # k3 would overflow on the unrelated numbers off policy tokens if they reached the estimate
    assert torch.isfinite(fn.kl_rewards(old * 100, ref, mask, 0.5, "k3")[0, 3])


def test_shape_rewards_and_policy_mask():
    r = torch.tensor([-3.0, 0.0, 1.0, 4.0])
    torch.testing.assert_close(fn.shape_rewards(r, bias=-0.5, scaling=2.0, clip=3.0), torch.tensor([-3, -1, 1, 3.0]))
    loss_mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]])
    attention = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 0]])  # row 1 starts at position 1 (left padding)
    got = fn.policy_mask(loss_mask, attention)
    assert got.tolist() == [[False, True, True, False], [False, False, True, False]]


def test_turn_runs():
    assert fn.turn_runs(torch.tensor([0, 1, 1, 0, 0, 1, 0, 1])) == [(1, 3), (5, 6), (7, 8)]
    assert fn.turn_runs(torch.tensor([0, 0])) == []


def test_normalize_turn_returns_counts_each_turn_once():
    # Two rows, one group: row 0 has a long turn (4 tokens) and a short one, row 1 one turn.
    mask = torch.tensor([[0, 1, 1, 1, 1, 0, 1], [0, 0, 1, 1, 0, 0, 0]], dtype=torch.bool)
    tr = torch.tensor([[0, 2.0, 2, 2, 2, 0, -1], [0, 0, 5, 5, 0, 0, 0]], dtype=torch.float64)
    norm = NormConfig(mean_level="group", std_level="group", group_size=2)
    got = fn.normalize_turn_returns(tr, mask, norm, shape=lambda r: r * 0.5)
    vals = torch.tensor([2.0, -1.0, 5.0], dtype=torch.float64) * 0.5  # one sample per turn, whatever its length
    z = (vals - vals.mean()) / (vals.std(unbiased=True) + norm.eps)
    want = torch.zeros(2, 7)
    want[0, 1:5], want[0, 6], want[1, 2:4] = z[0], z[1], z[2]
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="constant on each turn"):
        fn.normalize_turn_returns(tr + mask * torch.arange(7.0), mask, norm)
