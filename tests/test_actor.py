"""FSDPPPOActor: formulas against independent float64 references, packing, micro-batching, checkpoints, FSDP2.

The references here are written from the formulas stated in `areal_lite/utils/functional.py`'s docstring, with
plain Python loops over tokens; they share no code with `areal_lite.engine.fsdp_engine` or
`areal_lite.utils.functional` except the model forward (which we do not test). Gradients are read off an SGD step
with lr = 1 and no clipping: theta_before - theta_after = grad. The formulas are imported from
`areal_lite.engine.fsdp_engine`, their long-standing path.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from functools import partial

import pytest
import torch
from _bench import load_bench

from areal_lite.api.cli_args import MicroBatchSpec, NormConfig, OptimizerConfig, PPOActorConfig
from areal_lite.api.io_struct import FinetuneSpec, WeightUpdateMeta
from areal_lite.engine import fsdp_engine
from areal_lite.engine.fsdp_engine import (
    CPU_BF16_ENV,
    FSDPPPOActor,
    _precision_plan,
    count_policy_tokens,
)
from areal_lite.engine.fsdp_utils.packing import split_into_microbatches
from areal_lite.utils.device import BF16_MIN_SPEEDUP
from areal_lite.utils.functional import grpo_advantages, kl_estimate, normalize, ppo_token_loss

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(one_thread: bool = True) -> dict:
    """The environment of a child Python process of these tests: this checkout importable, and (`one_thread`) one
    OpenMP thread each."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if one_thread:
        env["OMP_NUM_THREADS"] = "1"
    return env


# ------------------------------------------------------------------------------------------------ helpers


def make_batch(vocab: int, B: int = 6, seed: int = 0, multiturn: bool = False) -> dict:
    """A right-padded batch of random prompts + responses with the contract's keys (logprobs filled later)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(B):
        p = int(torch.randint(2, 6, (1,), generator=g))
        if multiturn:
            r1, fb, r2 = (int(torch.randint(2, 5, (1,), generator=g)) for _ in range(3))
            lm = [0] * p + [1] * r1 + [0] * fb + [1] * r2
        else:
            r = int(torch.randint(2, 9, (1,), generator=g))
            lm = [0] * p + [1] * r
        ids = torch.randint(10, vocab, (len(lm),), generator=g)
        rows.append((ids, torch.tensor(lm)))
    L = max(len(r[0]) for r in rows)
    batch = {
        "input_ids": torch.zeros(B, L, dtype=torch.long),
        "attention_mask": torch.zeros(B, L, dtype=torch.bool),
        "loss_mask": torch.zeros(B, L, dtype=torch.long),
        "logprobs": torch.zeros(B, L),
        "versions": torch.full((B, L), -1, dtype=torch.long),
        "rewards": torch.randint(0, 2, (B,), generator=g).float(),
    }
    for i, (ids, lm) in enumerate(rows):
        n = len(ids)
        batch["input_ids"][i, :n] = ids
        batch["attention_mask"][i, :n] = True
        batch["loss_mask"][i, :n] = lm
        batch["versions"][i, :n] = torch.where(lm.bool(), 0, -1)
    return batch


def fill_logprobs(actor: FSDPPPOActor, batch: dict, seed: int = 1, noise: float = 0.4) -> None:
    """prox = current log-probs + noise, behaviour = prox + noise (so ratios and weights differ from 1)."""
    g = torch.Generator().manual_seed(seed)
    m = batch["loss_mask"].bool()
    cur = actor.compute_logp(batch).double()
    prox = cur + noise * torch.randn(cur.shape, generator=g, dtype=torch.float64)
    behav = prox + noise * torch.randn(cur.shape, generator=g, dtype=torch.float64)
    batch["prox_logp"] = torch.where(m, prox, torch.zeros(())).to(torch.float64)
    batch["logprobs"] = torch.where(m, behav, torch.zeros(())).to(torch.float64)


def actor_cfg(path: str, **kw) -> PPOActorConfig:
    opt = kw.pop("optimizer", OptimizerConfig(type="sgd", lr=1.0, gradient_clipping=0.0))
    return PPOActorConfig(path=path, dtype=kw.pop("dtype", "float64"), device="cpu", optimizer=opt, threads=1, **kw)


def params(actor: FSDPPPOActor) -> dict:
    return {n: p.detach().clone() for n, p in actor.model.named_parameters()}


def sgd_grads(actor: FSDPPPOActor, batch: dict) -> tuple[dict, dict]:
    """Run ppo_update with SGD lr=1 and return (grad per param, stats)."""
    before = params(actor)
    stats = actor.ppo_update(batch)
    after = params(actor)
    return {n: before[n] - after[n] for n in before}, stats


def reference_loss(model, batch: dict, cfg: PPOActorConfig) -> torch.Tensor:
    """The decoupled PPO loss of functional.py's docstring, token by token, in float64, on unpadded rows."""
    terms, count = [], 0
    eps_hi = cfg.eps_clip if cfg.eps_clip_higher is None else cfg.eps_clip_higher
    for i in range(batch["input_ids"].shape[0]):
        n = int(batch["attention_mask"][i].sum())
        ids = batch["input_ids"][i, :n]
        logits = model(input_ids=ids[None]).logits[0].double()
        for t in range(1, n):
            if not batch["loss_mask"][i, t]:
                continue
            lp = torch.log_softmax(logits[t - 1] / cfg.temperature, dim=-1)[ids[t]]
            A = float(batch["advantages"][i, t])
            behav = float(batch["logprobs"][i, t])
            prox = float(batch["prox_logp"][i, t]) if cfg.use_decoupled_loss else behav
            rho = torch.exp(lp - prox)
            L = torch.maximum(-A * rho, -A * torch.clamp(rho, 1 - cfg.eps_clip, 1 + eps_hi))
            if cfg.c_clip is not None and A < 0:
                L = torch.minimum(L, torch.tensor(cfg.c_clip * abs(A), dtype=torch.float64))
            w = math.exp(prox - behav) if cfg.use_decoupled_loss else 1.0
            if cfg.behav_imp_weight_cap is not None and w > cfg.behav_imp_weight_cap:
                w = 0.0
            terms.append(w * L)
            count += 1
    return torch.stack(terms).sum() / count


def reference_grads(path: str, batch: dict, cfg: PPOActorConfig) -> tuple[dict, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    loss = reference_loss(model, batch, cfg)
    loss.backward()
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
    return grads, loss.item()


def assert_close_dicts(a: dict, b: dict, atol: float, rtol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=rtol, msg=lambda m, k=k: f"{k}: {m}")


# ------------------------------------------------------------------------------------------------ pure formulas


def ref_normalize(x, mask, cfg):
    """Loop version of NormConfig normalisation for [B] or [B, L] inputs."""
    B = x.shape[0]
    G = cfg.group_size
    xs = x.double().reshape(B, -1)
    ms = mask.bool().reshape(B, -1)
    out = torch.zeros_like(xs)

    def pool_rows(i, level):
        if level == "batch":
            return range(B)
        g0 = (i // G) * G
        return range(g0, g0 + G)

    def mean_at(i, j):
        """The mean subtracted from entry (i, j)."""
        if cfg.mean_level == "none":
            return 0.0
        vals = [(r, c, float(xs[r, c])) for r in pool_rows(i, cfg.mean_level) for c in range(xs.shape[1]) if ms[r, c]]
        if cfg.mean_leave1out:
            others = [v for (r, c, v) in vals if (r, c) != (i, j)]
            return sum(others) / len(others) if others else 0.0
        return sum(v for *_, v in vals) / len(vals)

    for i in range(B):
        for j in range(xs.shape[1]):
            if not ms[i, j]:
                continue
            mu = mean_at(i, j)
            if cfg.std_level == "none":
                out[i, j] = float(xs[i, j]) - mu  # no scaling, and no eps (AReaL's rule)
                continue
            # the spread of every pool entry around the mean subtracted from it (AReaL 1.0.4's Normalization)
            devs = [
                (float(xs[r, c]) - mean_at(r, c)) ** 2
                for r in pool_rows(i, cfg.std_level)
                for c in range(xs.shape[1])
                if ms[r, c]
            ]
            d = len(devs) - 1 if cfg.std_unbiased else len(devs)
            sigma = math.sqrt(sum(devs) / d) if d > 0 else 0.0
            out[i, j] = (float(xs[i, j]) - mu) / (sigma + cfg.eps)
    return out.reshape(x.shape)


NORMS = [
    NormConfig(mean_level="group", std_level="group", group_size=4),
    NormConfig(mean_level="group", std_level="group", group_size=4, mean_leave1out=True),
    NormConfig(mean_level="group", std_level="batch", group_size=4, std_unbiased=False),
    NormConfig(mean_level="batch", std_level="batch", group_size=4, mean_leave1out=True, std_unbiased=False),
    NormConfig(mean_level="group", std_level="none", group_size=4),
    NormConfig(mean_level="none", std_level="group", group_size=2, eps=1e-3),
]


@pytest.mark.parametrize(
    "cfg", NORMS, ids=lambda c: f"{c.mean_level}-{c.std_level}-l1o{int(c.mean_leave1out)}-unb{int(c.std_unbiased)}"
)
def test_normalize_matches_loops(cfg):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, generator=g, dtype=torch.float64)
    torch.testing.assert_close(normalize(x, torch.ones(8, dtype=torch.bool), cfg), ref_normalize(x, torch.ones(8), cfg))
    xt = torch.randn(8, 5, generator=g, dtype=torch.float64)
    mt = torch.rand(8, 5, generator=g) > 0.3
    got = normalize(xt, mt, cfg)
    torch.testing.assert_close(got, torch.where(mt, ref_normalize(xt, mt, cfg), torch.zeros(())))


def test_normalize_constant_group_is_zero_and_bad_group_size_errors():
    cfg = NormConfig(mean_level="group", std_level="group", group_size=2)
    out = normalize(torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.ones(4, dtype=torch.bool), cfg)
    assert out[:2].abs().max() == 0
    assert out[2] < 0 < out[3]
    with pytest.raises(ValueError, match="multiple of group_size"):
        normalize(torch.ones(3), torch.ones(3, dtype=torch.bool), cfg)


def test_kl_estimators():
    a, b = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.5, -1.0, -0.5])
    d = a - b
    torch.testing.assert_close(kl_estimate(a, b, "k1"), d)
    torch.testing.assert_close(kl_estimate(a, b, "k2"), d**2 / 2)
    torch.testing.assert_close(kl_estimate(a, b, "k3"), torch.exp(-d) - 1 + d)
    with pytest.raises(ValueError):
        kl_estimate(a, b, "k4")


def test_ppo_token_loss_clip_dual_clip_and_cap_by_hand():
    # One token each: (logp, prox, behav, A)
    logp = torch.log(torch.tensor([1.5, 0.5, 3.0, 1.1, 1.0]))
    prox = torch.zeros(5)
    behav = torch.tensor([0.0, 0.0, 0.0, 0.0, -1.0])  # last: w = e > cap 2
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0])
    m = torch.ones(5, dtype=torch.bool)
    loss, info = ppo_token_loss(
        logp, prox, behav, adv, m, eps_clip=0.2, eps_clip_higher=0.28, c_clip=2.0, behav_imp_weight_cap=2.0
    )
    # A>0, rho=1.5: max(-1.5, -1.28) = -1.28 (clip-higher bound 1.28)
    # A<0, rho=0.5: max(0.5, 0.8) = 0.8 (lower clip)
    # A<0, rho=3.0: max(3.0, 1.28) = 3.0 -> dual clip min(3, 2) = 2
    # A>0, rho=1.1: inside the band -> -1.1
    # capped: weight 0
    torch.testing.assert_close(loss, torch.tensor([-1.28, 0.8, 2.0, -1.1, 0.0]))
    assert info["clipped"].tolist() == [True, True, False, False, False]
    assert info["dual_clipped"].tolist() == [False, False, True, False, False]
    assert info["capped"].tolist() == [False, False, False, False, True]


def test_grpo_advantages_sum_future_kl_over_policy_tokens():
    kl = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5]])
    mask = torch.tensor([[0, 1, 0, 1, 1]])
    r = torch.tensor([[2.0] * 5]) * mask
    adv = grpo_advantages(r, kl, mask)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 2 + 0.2 + 0.4 + 0.5, 0.0, 2 + 0.4 + 0.5, 2 + 0.5]]))


def test_split_into_microbatches():
    lengths = [5, 9, 3, 7, 2, 8]
    for spec in (
        MicroBatchSpec(n_mbs=1),
        MicroBatchSpec(n_mbs=3),
        MicroBatchSpec(max_tokens_per_mb=12),
        MicroBatchSpec(n_mbs=2, max_tokens_per_mb=10),
    ):
        mbs = split_into_microbatches(lengths, spec)
        assert sorted(i for mb in mbs for i in mb) == list(range(6))
        assert len(mbs) >= min(spec.n_mbs, 6)
        if spec.max_tokens_per_mb:
            assert all(sum(lengths[i] for i in mb) <= spec.max_tokens_per_mb for mb in mbs)
    assert split_into_microbatches([50, 1], MicroBatchSpec(max_tokens_per_mb=10)) == [[0], [1]]  # oversize alone
    assert len(split_into_microbatches([3, 3, 3], MicroBatchSpec(max_tokens_per_mb=6))) == 2


# ------------------------------------------------------------------------------------------------ the actor


def test_packed_logp_equals_per_sequence(tiny_model_path, vocab):
    from transformers import AutoModelForCausalLM

    actor = FSDPPPOActor(actor_cfg(tiny_model_path, dtype="float32", temperature=0.7)).initialize()
    batch = make_batch(vocab, B=5, seed=4)
    got = actor.compute_logp(batch)  # one packed row of all 5 sequences
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    for i in range(5):
        n = int(batch["attention_mask"][i].sum())
        ids = batch["input_ids"][i, :n]
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=ids[None]).logits[0] / 0.7, -1)
        want = torch.zeros(batch["input_ids"].shape[1])
        want[1:n] = lp[torch.arange(n - 1), ids[1:]]
        torch.testing.assert_close(got[i], want, atol=1e-5, rtol=0)
    # Token-budget packing into several micro-batches gives the same numbers.
    actor.config.mb_spec = MicroBatchSpec(max_tokens_per_mb=20)
    torch.testing.assert_close(actor.compute_logp(batch), got, atol=1e-5, rtol=0)
    actor.destroy()


def test_entropy_stat_is_the_mean_over_policy_tokens(tiny_model_path, vocab):
    # The update computes logits only where the next token is a policy token; the entropy it reports must still be
    # the mean, over policy tokens, of the entropy of the distribution that predicted each of them.
    from transformers import AutoModelForCausalLM

    actor = FSDPPPOActor(actor_cfg(tiny_model_path, temperature=0.7)).initialize()
    actor.skip_silent_rows = False  # zero advantages: every row would be skipped, and its statistics with it
    batch = make_batch(vocab, B=4, seed=8, multiturn=True)
    fill_logprobs(actor, batch)
    batch["advantages"] = torch.zeros(batch["input_ids"].shape, dtype=torch.float64)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float64)
    ents = []
    for i in range(4):
        n = int(batch["attention_mask"][i].sum())
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=batch["input_ids"][i, :n][None]).logits[0] / 0.7, -1)
        for t in range(1, n):
            if batch["loss_mask"][i, t]:
                ents.append(float(-(logp[t - 1].exp() * logp[t - 1]).sum()))
    stats = actor.ppo_update(batch)
    assert stats["entropy"] == pytest.approx(sum(ents) / len(ents), rel=1e-6)  # computed in float32
    assert stats["n_tokens"] == len(ents)
    actor.destroy()


LOSS_CASES = {
    "plain": dict(),
    "clip_higher_dual_cap": dict(eps_clip=0.1, eps_clip_higher=0.3, c_clip=1.5, behav_imp_weight_cap=1.3),
    "not_decoupled": dict(use_decoupled_loss=False, eps_clip=0.15),
    "temperature": dict(temperature=0.6, c_clip=3.0),
}


@pytest.mark.parametrize("case", list(LOSS_CASES))
def test_loss_and_grads_match_float64_reference(tiny_model_path, vocab, case):
    cfg = actor_cfg(tiny_model_path, **LOSS_CASES[case])
    actor = FSDPPPOActor(cfg).initialize()
    batch = make_batch(vocab, B=6, seed=10)
    fill_logprobs(actor, batch, noise=0.6)
    g = torch.Generator().manual_seed(5)
    batch["advantages"] = torch.randn(batch["input_ids"].shape, generator=g, dtype=torch.float64) * batch["loss_mask"]
    grads, stats = sgd_grads(actor, batch)
    ref, ref_loss = reference_grads(tiny_model_path, batch, cfg)
    assert stats["loss"] == pytest.approx(ref_loss, rel=1e-10, abs=1e-12)
    assert_close_dicts(grads, ref, atol=1e-11, rtol=1e-8)
    if case == "clip_higher_dual_cap":  # the data really exercises every branch
        assert stats["clip_frac"] > 0 and stats["dual_clip_frac"] > 0 and stats["behav_capped_frac"] > 0
    assert stats["skipped"] == 0 and stats["n_tokens"] == float(
        (batch["loss_mask"].bool() & batch["attention_mask"]).sum()
    )
    actor.destroy()


@pytest.mark.parametrize(
    "spec",
    [MicroBatchSpec(n_mbs=3), MicroBatchSpec(max_tokens_per_mb=24), MicroBatchSpec(n_mbs=2, max_tokens_per_mb=16)],
)
def test_microbatching_gives_the_same_gradient(tiny_model_path, vocab, spec):
    batch = make_batch(vocab, B=7, seed=21)
    grads = []
    for mb in (MicroBatchSpec(n_mbs=1), spec):
        actor = FSDPPPOActor(actor_cfg(tiny_model_path, mb_spec=mb, c_clip=2.0)).initialize()
        b = {k: v.clone() for k, v in batch.items()}
        fill_logprobs(actor, b)
        b["advantages"] = torch.linspace(-1, 1, b["input_ids"].numel()).view_as(b["logprobs"]).double() * b["loss_mask"]
        grads.append(sgd_grads(actor, b)[0])
        actor.destroy()
    assert_close_dicts(grads[0], grads[1], atol=1e-12, rtol=1e-9)


def test_ppo_minibatches_are_sequential_steps(tiny_model_path, vocab):
    batch = make_batch(vocab, B=6, seed=2)
    a = FSDPPPOActor(
        actor_cfg(
            tiny_model_path, ppo_n_minibatches=2, optimizer=OptimizerConfig(type="sgd", lr=0.5, gradient_clipping=0.0)
        )
    ).initialize()
    fill_logprobs(a, batch)
    batch["advantages"] = torch.randn(batch["logprobs"].shape, dtype=torch.float64) * batch["loss_mask"]
    a.ppo_update(batch)
    b = FSDPPPOActor(
        actor_cfg(tiny_model_path, optimizer=OptimizerConfig(type="sgd", lr=0.5, gradient_clipping=0.0))
    ).initialize()
    for rows in (slice(0, 3), slice(3, 6)):
        b.ppo_update({k: v[rows] for k, v in batch.items()})
    assert_close_dicts(params(a), params(b), atol=1e-13)


def learner_ppo_loss(logprobs, entropy, input_data, eps_clip=0.2, mistake=None):
    """The decoupled PPO loss as a notebook learner writes it for `train_batch` (no package code), or with a mistake."""
    m = input_data["loss_mask"].double()
    prox, behav, adv = input_data["prox_logp"], input_data["logprobs"], input_data["advantages"]
    if mistake == "ratio to the behaviour policy":
        prox = behav
    ratio = torch.exp(logprobs - prox)
    clipped = ratio if mistake == "no clip" else ratio.clamp(1 - eps_clip, 1 + eps_clip)
    surrogate = torch.maximum(-adv * ratio, -adv * clipped)
    weight = torch.exp(prox - behav).detach()
    if mistake == "no behaviour weight":
        weight = torch.ones_like(weight)
    total = (surrogate * weight * m).sum()
    return total if mistake == "sum, not mean" else total / m.sum()


LOSS_MISTAKES = ["ratio to the behaviour policy", "no clip", "no behaviour weight", "sum, not mean"]


def trained_with(path, batch, loss=None, mb_spec=None, **kw):
    """Weights after one step from the same start: ppo_update (loss=None) or train_batch with `loss`."""
    opt = OptimizerConfig(type="sgd", lr=0.5, gradient_clipping=0.0)
    actor = FSDPPPOActor(actor_cfg(path, optimizer=opt, mb_spec=mb_spec or MicroBatchSpec(n_mbs=1))).initialize()
    b = {k: v.clone() for k, v in batch.items()}
    if loss is None:
        stats = actor.ppo_update(b)
    else:
        stats = actor.train_batch(b, loss_fn=partial(loss, **kw), loss_weight_fn=count_policy_tokens)
    out = params(actor)
    actor.destroy()
    return out, stats


@pytest.fixture(scope="module")
def loss_batch(tiny_model_path, vocab):
    batch = make_batch(vocab, B=6, seed=5)
    actor = FSDPPPOActor(actor_cfg(tiny_model_path)).initialize()
    fill_logprobs(actor, batch, noise=0.3)
    actor.destroy()
    batch["advantages"] = torch.randn(
        batch["logprobs"].shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3)
    )
    batch["advantages"] *= batch["loss_mask"]
    return batch


@pytest.fixture(scope="module")
def package_step(tiny_model_path, loss_batch):
    """(weights before, weights after ppo_update, its stats): what every learner's loss is compared with."""
    start = FSDPPPOActor(actor_cfg(tiny_model_path)).initialize()
    before = params(start)
    start.destroy()
    return (before, *trained_with(tiny_model_path, loss_batch))


def test_train_batch_with_the_learners_loss_trains_what_ppo_update_trains(tiny_model_path, loss_batch, package_step):
    """A notebook's own loss goes through `train_batch`, the path `ppo_update` takes: same weights, same stats."""
    _, package, package_stats = package_step
    for spec in (MicroBatchSpec(n_mbs=1), MicroBatchSpec(n_mbs=3)):  # the global mean, however it is split
        mine, stats = trained_with(tiny_model_path, loss_batch, learner_ppo_loss, mb_spec=spec)
        assert_close_dicts(package, mine, atol=1e-12, rtol=1e-9)
        for key in ("loss", "clip_frac", "approx_kl", "entropy", "n_tokens"):
            assert stats[key] == pytest.approx(package_stats[key], rel=1e-9, abs=1e-12), key


@pytest.mark.parametrize("mistake", LOSS_MISTAKES)
def test_a_wrong_loss_trains_different_weights(tiny_model_path, loss_batch, package_step, mistake):
    """What the notebook promises: if the learner's loss is wrong, what is trained changes (by far more than noise)."""
    before, package, _ = package_step
    wrong, _ = trained_with(tiny_model_path, loss_batch, learner_ppo_loss, mistake=mistake)
    step = sum(float((package[n] - before[n]).norm() ** 2) for n in before) ** 0.5
    off = sum(float((package[n] - wrong[n]).norm() ** 2) for n in before) ** 0.5
    assert off > 0.05 * step, f"{mistake}: the wrong loss moved the weights {off:.2e} from the right step ({step:.2e})"


def test_gradient_checkpointing_same_gradient(tiny_model_path, vocab):
    batch = make_batch(vocab, B=4, seed=8)
    out = []
    for gc in (False, True):
        actor = FSDPPPOActor(actor_cfg(tiny_model_path, gradient_checkpointing=gc)).initialize()
        b = {k: v.clone() for k, v in batch.items()}
        fill_logprobs(actor, b)
        b["advantages"] = b["loss_mask"].double()
        out.append(sgd_grads(actor, b)[0])
    assert_close_dicts(out[0], out[1], atol=1e-12)


def ref_advantages(batch, cfg, reward_norm=None, adv_norm=None, ref_logp=None):
    """GRPO advantages with explicit loops (float64)."""
    B, L = batch["input_ids"].shape
    R = [
        min(max((float(r) + cfg.reward_bias) * cfg.reward_scaling, -cfg.reward_clip), cfg.reward_clip)
        for r in batch["rewards"]
    ]
    R = torch.tensor(R, dtype=torch.float64)
    if reward_norm is not None:
        R = ref_normalize(R, torch.ones(B), reward_norm)
    pm = batch["loss_mask"].bool() & batch["attention_mask"]
    pm[:, 0] = False
    A = torch.zeros(B, L, dtype=torch.float64)
    for i in range(B):
        for t in range(L):
            if not pm[i, t]:
                continue
            total = float(R[i])
            for k in range(t, L):
                if pm[i, k] and ref_logp is not None:
                    d = float(batch["logprobs"][i, k]) - float(ref_logp[i, k])
                    est = {"k1": d, "k2": d * d / 2, "k3": math.exp(-d) - 1 + d}[cfg.kl_estimator]
                    total += -cfg.kl_ctl * est
            A[i, t] = total
    if adv_norm is not None:
        A = torch.where(pm, ref_normalize(A, pm, adv_norm), torch.zeros(()))
    return A


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_compute_advantages_with_kl_and_norms(tiny_model_path, vocab, estimator):
    rn = NormConfig(mean_level="group", std_level="group", group_size=3, mean_leave1out=True)
    an = NormConfig(mean_level="batch", std_level="batch", group_size=3)
    cfg = actor_cfg(
        tiny_model_path,
        kl_ctl=0.3,
        kl_estimator=estimator,
        reward_norm=rn,
        adv_norm=an,
        reward_bias=-0.5,
        reward_scaling=3.0,
        reward_clip=1.2,
        group_size=3,
    )
    actor = FSDPPPOActor(cfg).initialize()
    batch = make_batch(vocab, B=6, seed=6)
    batch["rewards"] = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    fill_logprobs(actor, batch)
    g = torch.Generator().manual_seed(1)
    batch["ref_logp"] = batch["logprobs"] + 0.3 * torch.randn(batch["logprobs"].shape, generator=g, dtype=torch.float64)
    inputs = {k: v.clone() for k, v in batch.items()}
    actor.compute_advantages(batch)
    want = ref_advantages(inputs, cfg, reward_norm=rn, adv_norm=an, ref_logp=inputs["ref_logp"])
    torch.testing.assert_close(batch["advantages"].double(), want, atol=1e-5, rtol=1e-5)
    first = {k: v.clone() for k, v in batch.items()}
    actor.compute_advantages(batch)  # idempotent, and never rewrites its inputs
    for k in first:
        torch.testing.assert_close(batch[k], first[k], atol=0, rtol=0)
    for k in inputs:
        torch.testing.assert_close(batch[k], inputs[k], atol=0, rtol=0)


def test_kl_uses_reference_model(tiny_model_path, vocab):
    ref_cfg = actor_cfg(tiny_model_path)
    actor = FSDPPPOActor(actor_cfg(tiny_model_path, kl_ctl=0.1), ref_config=ref_cfg).initialize()
    batch = make_batch(vocab, B=2, seed=1)
    fill_logprobs(actor, batch)
    actor.compute_advantages(batch)
    torch.testing.assert_close(batch["ref_logp"], actor.compute_logp(batch))  # same initial weights
    assert batch["kl_rewards"].abs().sum() > 0
    with pytest.raises(RuntimeError, match="reference"):
        FSDPPPOActor(actor_cfg(tiny_model_path, kl_ctl=0.1)).initialize().compute_advantages(make_batch(vocab, B=2))


def test_token_returns_normalised_per_turn(tiny_model_path, vocab):
    rn = NormConfig(mean_level="group", std_level="group", group_size=2)
    actor = FSDPPPOActor(actor_cfg(tiny_model_path, reward_norm=rn, group_size=2)).initialize()
    batch = make_batch(vocab, B=4, seed=9, multiturn=True)
    tr = torch.zeros(batch["logprobs"].shape)
    turn_vals = [[0.9, 1.0], [-0.81, -0.9], [0.5, 0.2], [1.0, -1.0]]
    for i in range(4):
        lm = batch["loss_mask"][i].tolist()
        k, prev = -1, 0
        for t, v in enumerate(lm):
            if v and not prev:
                k += 1
            if v:
                tr[i, t] = turn_vals[i][k]
            prev = v
    batch["token_returns"] = tr
    actor.compute_advantages(batch)
    # Reference: per group, the 4 (row, turn) returns are the samples.
    for g0 in (0, 2):
        vals = torch.tensor(turn_vals[g0] + turn_vals[g0 + 1], dtype=torch.float64)
        z = (vals - vals.mean()) / (vals.std(unbiased=True) + rn.eps)
        for r in range(2):
            i = g0 + r
            lm = batch["loss_mask"][i].tolist()
            starts = [t for t in range(len(lm)) if lm[t] and (t == 0 or not lm[t - 1])]
            for k, s in enumerate(starts):
                assert batch["advantages"][i, s].item() == pytest.approx(float(z[2 * r + k]), abs=1e-5)
    # Non-constant returns within a turn are refused with a clear message.
    batch["token_returns"] = tr + torch.rand(tr.shape) * batch["loss_mask"]
    with pytest.raises(ValueError, match="constant on each turn"):
        actor.compute_advantages(batch)


def test_nonfinite_gradient_skips_the_step(tiny_model_path, vocab):
    actor = FSDPPPOActor(actor_cfg(tiny_model_path, dtype="float32", optimizer=OptimizerConfig(lr=1e-2))).initialize()
    batch = make_batch(vocab, B=3, seed=3)
    fill_logprobs(actor, batch)
    actor.compute_advantages(batch)
    adv = batch["advantages"].clone()
    i, t = torch.nonzero(batch["loss_mask"][:, 1:])[0].tolist()
    adv[i, t + 1] = float("nan")
    batch["advantages"] = adv
    before = params(actor)
    stats = actor.ppo_update(batch)
    assert stats["skipped"] == 1.0 and not math.isfinite(stats["grad_norm"])
    assert_close_dicts(before, params(actor), atol=0)
    assert all(p.grad is None for p in actor.model.parameters())
    batch["advantages"] = torch.nan_to_num(adv)
    assert actor.ppo_update(batch)["skipped"] == 0.0  # next step trains normally


@pytest.mark.filterwarnings(r"ignore:Detected call of `lr_scheduler.step\(\)`")
def test_lr_schedules(tiny_model_path):
    spec = FinetuneSpec(total_train_epochs=1, dataset_size=10, train_batch_size=1)  # 10 steps
    for kind, expect in [
        ("constant", [0.5, 1, 1, 1, 1, 1, 1, 1, 1, 1]),
        ("linear", [0.5, 1.0, 1.0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125]),
    ]:
        opt = OptimizerConfig(lr=2.0, lr_scheduler_type=kind, warmup_steps_proportion=0.2)
        actor = FSDPPPOActor(actor_cfg(tiny_model_path, optimizer=opt)).initialize(spec)
        lrs = []
        for _ in range(10):
            lrs.append(actor.optimizer.param_groups[0]["lr"] / 2.0)
            actor.step_lr_scheduler()
        assert lrs == pytest.approx(expect)
    opt = OptimizerConfig(lr=1.0, lr_scheduler_type="cosine", min_lr_ratio=0.1)
    actor = FSDPPPOActor(actor_cfg(tiny_model_path, optimizer=opt)).initialize(None, spec)  # AReaL's signature too
    lrs = []
    for _ in range(10):
        lrs.append(actor.optimizer.param_groups[0]["lr"])
        actor.step_lr_scheduler()
    assert lrs[0] == pytest.approx(1.0) and lrs[5] == pytest.approx(0.55) and min(lrs) > 0.1


def test_save_load_roundtrip_restores_exactly(tiny_model_path, vocab, tmp_path):
    cfg = actor_cfg(tiny_model_path, dtype="float32", optimizer=OptimizerConfig(lr=1e-3, lr_scheduler_type="linear"))
    spec = FinetuneSpec(total_train_epochs=1, dataset_size=8, train_batch_size=1)
    batches = []
    for s in range(3):
        b = make_batch(vocab, B=4, seed=30 + s)
        b["logprobs"] = -torch.rand(b["logprobs"].shape) * b["loss_mask"]
        batches.append(b)

    def step(actor, b):
        b = {k: v.clone() for k, v in b.items()}
        b["prox_logp"] = actor.compute_logp(b)
        actor.compute_advantages(b)
        actor.ppo_update(b)
        actor.step_lr_scheduler()

    a = FSDPPPOActor(cfg).initialize(spec)
    step(a, batches[0])
    a.set_version(7)
    a.save(str(tmp_path / "ckpt"))
    torch.manual_seed(123)
    step(a, batches[1])
    step(a, batches[2])
    r1 = torch.rand(3)
    b = FSDPPPOActor(cfg).initialize(spec)
    b.load(str(tmp_path / "ckpt"))
    assert b.get_version() == 7
    step(b, batches[1])
    step(b, batches[2])
    assert_close_dicts(params(a), params(b), atol=0)
    assert b.optimizer.param_groups[0]["lr"] == a.optimizer.param_groups[0]["lr"]
    torch.manual_seed(123)
    assert torch.equal(torch.rand(3), r1)
    with pytest.raises(FileNotFoundError, match="not an actor checkpoint"):
        b.load(str(tmp_path))


def test_an_actor_without_an_optimizer_scores_but_refuses_to_train(tiny_model_path, vocab, tmp_path):
    """AReaL's optimizer=None (an engine that does not train): log-probs and checkpoints work; a training call says
    why it cannot (AReaL asserts), and a trained actor refuses its optimizer-less checkpoint's missing state."""
    frozen = FSDPPPOActor(actor_cfg(tiny_model_path, optimizer=None)).initialize()
    assert frozen.optimizer is None and frozen.lr_scheduler is None
    batch = make_batch(vocab)
    fill_logprobs(frozen, batch)
    frozen.compute_advantages(batch)
    before = params(frozen)
    for call in (lambda: frozen.ppo_update(batch), frozen.step_lr_scheduler):
        with pytest.raises(RuntimeError, match="no optimizer .*give it an OptimizerConfig"):
            call()
    assert_close_dicts(params(frozen), before, atol=0)
    frozen.save(str(tmp_path / "ckpt"))
    again = FSDPPPOActor(actor_cfg(tiny_model_path, optimizer=None)).initialize()
    with torch.no_grad():
        next(again.model.parameters()).add_(1.0)
    again.load(str(tmp_path / "ckpt"))
    assert_close_dicts(params(again), before, atol=0)
    trained = FSDPPPOActor(actor_cfg(tiny_model_path)).initialize()
    with pytest.raises(RuntimeError, match="has no optimizer state"):
        trained.load(str(tmp_path / "ckpt"))


def test_update_weights_atomic_loadable_and_pruned(tiny_model_path, vocab, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    actor = FSDPPPOActor(actor_cfg(tiny_model_path, dtype="float32", optimizer=OptimizerConfig(lr=1e-2))).initialize()
    meta = WeightUpdateMeta.from_disk(path=str(tmp_path / "w"), keep_last=2)
    original = actor._write_hf_folder
    seen = []

    def spy(state, out_dir):
        final = meta.dir_for(actor.get_version() + 1)
        seen.append(os.path.exists(final))  # the final name must not exist while files are written
        assert os.path.dirname(out_dir) == os.path.dirname(final)
        original(state, out_dir)

    monkeypatch.setattr(actor, "_write_hf_folder", spy)
    batch = make_batch(vocab, B=2, seed=5)
    for v in range(4):
        b = {k: x.clone() for k, x in batch.items()}
        b["prox_logp"] = actor.compute_logp(b)
        b["logprobs"] = b["prox_logp"] * b["loss_mask"]
        actor.compute_advantages(b)
        actor.ppo_update(b)
        actor.update_weights(meta)
        actor.set_version(v + 1)
    assert seen == [False] * 4
    root = os.path.dirname(meta.dir_for(4))  # versions sit side by side: <root>/weight_update_v<k> (AReaL's names)
    assert sorted(os.listdir(root)) == ["weight_update_v3", "weight_update_v4"]  # pruned, no temp folders left
    loaded = AutoModelForCausalLM.from_pretrained(meta.dir_for(4), dtype=torch.float32)
    for n, p in actor.model.named_parameters():
        torch.testing.assert_close(loaded.get_parameter(n), p.detach(), atol=0, rtol=0)
    AutoTokenizer.from_pretrained(meta.dir_for(4))  # a complete folder: the server can load it alone
    with torch.no_grad():
        x = batch["input_ids"][:1, :4]
        torch.testing.assert_close(loaded(input_ids=x).logits, actor.model(input_ids=x).logits)
    with pytest.raises(NotImplementedError, match="CUDA"):
        actor.upload_weights(WeightUpdateMeta.from_nccl("127.0.0.1", 1))
    # Weight versions are transport, not checkpoints: destroy() removes them (and the folder, left empty) ...
    actor.destroy()
    assert not os.path.exists(root)


def test_destroy_keeps_files_it_did_not_write(tiny_model_path, tmp_path):
    actor = FSDPPPOActor(actor_cfg(tiny_model_path, dtype="float32")).initialize()
    meta = WeightUpdateMeta(type="disk", path=str(tmp_path / "w" / "weight_update"))  # AReaL's way to say a folder
    root = os.path.dirname(meta.path)
    os.makedirs(root)
    with open(os.path.join(root, "notes.txt"), "w") as f:
        f.write("mine")
    actor.update_weights(meta.with_version(1))  # AReaL's versioned meta: written to <root>/weight_update_v1
    assert sorted(os.listdir(root)) == ["notes.txt", "weight_update_v1"]
    actor.destroy()
    assert os.listdir(root) == ["notes.txt"]  # ... but nothing else in a folder the user gave


RECEIVER = textwrap.dedent(
    """
    import sys, torch
    from areal_lite.engine.fsdp_utils.weights import init_custom_process_group
    import torch.distributed as dist
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    addr, path = sys.argv[1], sys.argv[2]
    model = AutoModelForCausalLM.from_pretrained(path)  # the "server": same architecture, stale weights
    group = init_custom_process_group("gloo", addr, world_size=2, rank=1, group_name=f"weights-{addr}")
    for name, p in model.named_parameters():
        buf = torch.empty_like(p.data)
        dist.broadcast(buf, src=0, group=group)
        p.data.copy_(buf)
    model.save_pretrained(sys.argv[3])
    """
)


def test_parameter_broadcast_over_a_custom_group(tiny_model_path, vocab, tmp_path):
    """The NCCL route's mechanics with gloo: a process outside the trainer's world joins a custom group and
    receives every parameter in `weight_update_specs()` order (the GPU route only swaps gloo for NCCL)."""
    from areal_lite.engine.fsdp_utils.weights import init_custom_process_group
    from areal_lite.kit.server.procs import find_free_port

    actor = FSDPPPOActor(actor_cfg(tiny_model_path, dtype="float32", optimizer=OptimizerConfig(lr=1e-2))).initialize()
    with torch.no_grad():
        for p in actor.model.parameters():
            p.add_(0.01)  # weights the receiver does not have yet
    script = tmp_path / "recv.py"
    script.write_text(RECEIVER)
    addr = f"tcp://127.0.0.1:{find_free_port()}"
    env = child_env()
    proc = subprocess.Popen(
        [sys.executable, str(script), addr, tiny_model_path, str(tmp_path / "got")],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # a group name is registered for the life of the process: one per run, so the test can run again in it
        group = init_custom_process_group("gloo", addr, world_size=2, rank=0, group_name=f"weights-{addr}")
        actor._broadcast_params(group)
        assert proc.wait(timeout=120) == 0, proc.stderr.read()[-3000:]
    finally:
        proc.kill()
    from transformers import AutoModelForCausalLM

    got = AutoModelForCausalLM.from_pretrained(str(tmp_path / "got"))
    for n, p in actor.model.named_parameters():
        torch.testing.assert_close(got.get_parameter(n), p.detach(), atol=0, rtol=0)
    assert [s["name"] for s in actor.weight_update_specs()] == [n for n, _ in actor.model.named_parameters()]
    meta = actor.prepare_nccl_meta(WeightUpdateMeta.from_nccl("127.0.0.1", 1), n_server_gpus=2)
    assert meta.nccl_world_size == 3 and len(meta.names) == len(meta.shapes) == len(meta.dtypes)


# ------------------------------------------------------------------------------------------------ FSDP2


FSDP_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    torch.set_num_threads(1)
    from areal_lite.engine.fsdp_engine import FSDPPPOActor, count_policy_tokens
    from areal_lite.api.cli_args import MicroBatchSpec, OptimizerConfig, PPOActorConfig
    from areal_lite.api.io_struct import WeightUpdateMeta

    model_path, batch_path, out_path, n_mbs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    cfg = PPOActorConfig(path=model_path, device="cpu", threads=1, c_clip=3.0,
                         optimizer=OptimizerConfig(type="sgd", lr=100.0, gradient_clipping=0.0),
                         mb_spec=MicroBatchSpec(n_mbs=n_mbs))
    actor = FSDPPPOActor(cfg).initialize()
    batch = torch.load(batch_path)
    batch["prox_logp"] = actor.compute_logp(batch)
    actor.compute_advantages(batch)
    stats = actor.ppo_update(batch)
    actor.update_weights(WeightUpdateMeta.from_disk(path=out_path + ".weights"))
    state = actor._full_state_dict()
    if int(os.environ.get("RANK", "0")) == 0:
        from safetensors.torch import load_file
        saved = load_file(out_path + ".weights/weight_update_v1/model.safetensors")  # read before destroy() removes it
        torch.save({"state": state, "stats": stats, "prox": batch["prox_logp"], "saved": saved}, out_path)
    actor.destroy()
    """
)


def save_fsdp_batch(vocab: int, path) -> None:
    """The batch the FSDP tests train on, saved for their torchrun processes."""
    batch = make_batch(vocab, B=5, seed=11)  # odd B: ranks get 3 and 2 rows, and different micro-batch counts
    g = torch.Generator().manual_seed(0)
    batch["logprobs"] = -torch.rand(batch["logprobs"].shape, generator=g) * batch["loss_mask"]
    batch["rewards"] = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0])
    torch.save(batch, path)


def run_fsdp_steps(
    script_text: str, model_path: str, vocab: int, tmp_path, env: dict, timeout: float, torchrun_alone: bool
) -> dict:
    """`FSDP_SCRIPT` (as `script_text`) on one process and on two (torchrun, FSDP2): {1: results, 2: results}.
    `torchrun_alone`: the one process under torchrun too, else as plain Python (no process group at all)."""
    script = tmp_path / "fsdp_step.py"
    script.write_text(script_text)
    batch = tmp_path / "batch.pt"
    save_fsdp_batch(vocab, batch)
    results = {}
    for nproc in (1, 2):
        out = tmp_path / f"out{nproc}.pt"
        args = [str(script), model_path, str(batch), str(out), "2"]
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
        cmd = [*torchrun, *args] if nproc == 2 or torchrun_alone else [sys.executable, *args]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, proc.stderr[-4000:]
        results[nproc] = torch.load(out)
    return results


def test_fsdp2_two_processes_equal_one(tiny_model_path, vocab, tmp_path):
    """torchrun --nproc-per-node 2 (gloo, FSDP2 fully_shard) == one process, after one PPO step."""
    results = run_fsdp_steps(FSDP_SCRIPT, tiny_model_path, vocab, tmp_path, child_env(), 300, torchrun_alone=False)
    one, two = results[1], results[2]
    torch.testing.assert_close(two["prox"], one["prox"], atol=1e-6, rtol=0)
    assert one["state"].keys() == two["state"].keys()
    for k in one["state"]:
        torch.testing.assert_close(two["state"][k], one["state"][k], atol=1e-5, rtol=0, msg=lambda m, k=k: f"{k}: {m}")
    from safetensors.torch import load_file

    init = load_file(os.path.join(tiny_model_path, "model.safetensors"))
    moved = max((one["state"][k] - init[k]).abs().max().item() for k in init)
    assert moved > 5e-3  # the step really moved the weights, far beyond the tolerance
    for key in ("loss", "grad_norm", "n_tokens", "clip_frac"):
        assert two["stats"][key] == pytest.approx(one["stats"][key], rel=1e-4, abs=1e-6)
    # The FSDP run also wrote a weight folder equal to its state.
    for k, v in two["saved"].items():
        torch.testing.assert_close(v, two["state"][k], atol=0, rtol=0)


def test_areals_list_of_trajectories_gives_the_same_step_as_one_batch(tiny_model_path, vocab):
    """AReaL's shapes: compute_logp -> one tensor per trajectory, compute_advantages -> the list with advantages
    (normalised over all trajectories together), ppo_update on the list == on the joined batch. int32 as AReaL."""
    from areal_lite.utils.data import concat_padded_tensors

    cfg = dict(group_size=2, reward_norm=NormConfig(mean_level="group", std_level="group", group_size=2))
    whole = make_batch(vocab, B=6, seed=11)
    whole["rewards"] = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.0, 1.0])
    n = whole["attention_mask"].sum(-1)
    groups = []
    for g in range(3):  # three groups of two rows, each cut to its own length and cast to AReaL's dtypes
        rows = slice(2 * g, 2 * g + 2)
        L = int(n[rows].max())
        item = {k: (v[rows, :L] if v.dim() == 2 else v[rows]) for k, v in whole.items()}
        for k in ("input_ids", "loss_mask", "versions"):
            item[k] = item[k].int()
        groups.append(item)
    joined = concat_padded_tensors([dict(g) for g in groups])
    a = FSDPPPOActor(actor_cfg(tiny_model_path, **cfg)).initialize()
    b = FSDPPPOActor(actor_cfg(tiny_model_path, **cfg)).initialize()

    logps = a.compute_logp(groups)
    assert isinstance(logps, list) and [t.shape for t in logps] == [g["input_ids"].shape for g in groups]
    for g, lp in zip(groups, logps):
        g["prox_logp"] = lp
    joined["prox_logp"] = b.compute_logp(joined)
    torch.testing.assert_close(concat_padded_tensors([{"x": lp} for lp in logps])["x"], joined["prox_logp"])

    out = a.compute_advantages(groups)
    assert out is groups and all("advantages" in g for g in groups)
    b.compute_advantages(joined)
    torch.testing.assert_close(
        concat_padded_tensors([{"x": g["advantages"]} for g in groups])["x"], joined["advantages"]
    )
    a.ppo_update(groups)
    b.ppo_update(joined)
    for (name, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        torch.testing.assert_close(p, q, msg=name)


def test_disable_dropout_zeroes_every_dropout(tmp_path):
    """AReaL's `disable_dropout` is honoured: a model built with dropout trains without it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from areal_lite.api.cli_args import PPOActorConfig
    from areal_lite.engine.fsdp_engine import FSDPPPOActor

    cfg = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, attention_dropout=0.3)  # fmt: skip
    Qwen2ForCausalLM(cfg).save_pretrained(tmp_path)
    actor = FSDPPPOActor(PPOActorConfig(path=str(tmp_path), dtype="float32", device="cpu", disable_dropout=True))
    actor.initialize(None, None)
    rates = [m.attention_dropout for m in actor.model.modules() if hasattr(m, "attention_dropout")]
    rates += [m.p for m in actor.model.modules() if isinstance(m, torch.nn.Dropout)]
    assert rates and all(r == 0.0 for r in rates)
    actor.destroy()


def test_one_minibatch_needs_no_separate_proximal_pass(tiny_model_path, loss_batch):
    """With one optimizer step on the batch, the proximal policy is the weights of the update's own forward pass:
    ppo_update without `prox_logp` (no compute_logp pass) trains what it trains with a recomputed `prox_logp`."""
    assert PPOActorConfig().use_decoupled_loss and PPOActorConfig().ppo_n_minibatches == 1  # what trained_with runs
    b = {k: v for k, v in loss_batch.items() if k != "prox_logp"}
    recomputed = dict(b)
    actor = FSDPPPOActor(actor_cfg(tiny_model_path)).initialize()
    recomputed["prox_logp"] = actor.compute_logp(recomputed)
    actor.destroy()
    with_pass, stats_a = trained_with(tiny_model_path, recomputed)
    actor = FSDPPPOActor(
        actor_cfg(tiny_model_path, optimizer=OptimizerConfig(type="sgd", lr=0.5, gradient_clipping=0.0))
    ).initialize()

    def no_second_pass(batch):
        raise AssertionError("ppo_update ran a separate log-prob pass with one minibatch")

    actor.compute_logp = no_second_pass
    stats_b = actor.ppo_update({k: v.clone() for k, v in b.items()})
    without = params(actor)
    actor.destroy()
    assert_close_dicts(with_pass, without, atol=1e-6, rtol=1e-5)
    for key in ("loss", "clip_frac", "approx_kl"):
        assert stats_b[key] == pytest.approx(stats_a[key], rel=1e-5, abs=1e-7), key


def test_rows_without_signal_run_no_forward_and_change_nothing(tiny_model_path, loss_batch):
    """Rows whose advantages are all zero add exactly nothing to ppo_update's loss or gradient: skipping their
    forward and backward gives the same weights and loss, AdamW state included, also when every row is silent
    (AdamW still steps on zero gradients: momentum and weight decay move the weights)."""
    mixed = {k: v.clone() for k, v in loss_batch.items()}
    mixed["advantages"][[1, 4]] = 0.0  # two silent rows among six
    silent = {k: v.clone() for k, v in loss_batch.items()}
    silent["advantages"].zero_()
    runs = []
    for skip in (True, False):
        opt = OptimizerConfig(type="adam", lr=1e-2, weight_decay=0.1, gradient_clipping=1.0)
        actor = FSDPPPOActor(actor_cfg(tiny_model_path, optimizer=opt)).initialize()
        actor.skip_silent_rows = skip
        forwards = []

        def counted(model, packed, m, forwards=forwards, policy_logp=actor._policy_logp):
            forwards.append(int(packed["input_ids"].numel()))  # tokens in this forward pass
            return policy_logp(model, packed, m)

        actor._policy_logp = counted
        stats = [actor.ppo_update({k: v.clone() for k, v in b.items()}) for b in (mixed, silent)]
        runs.append((params(actor), stats, forwards))
        actor.destroy()
    (w_skip, s_skip, f_skip), (w_all, s_all, f_all) = runs
    assert_close_dicts(w_skip, w_all, atol=1e-12, rtol=1e-9)
    for a, b in zip(s_skip, s_all):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-9, abs=1e-15)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-9, abs=1e-15)
    assert [s["silent_rows"] for s in s_skip] == [2.0, 6.0] and [s["silent_rows"] for s in s_all] == [0.0, 0.0]
    valid = loss_batch["attention_mask"].sum(dim=1)
    assert sum(f_skip) < sum(f_all) and sum(f_all) == 2 * int(valid.sum())  # forwards skipped, not just masked
    assert s_skip[0]["n_tokens"] < s_all[0]["n_tokens"]  # the stats cover the computed rows


# ------------------------------------------------------------------------------------------------ bfloat16 on a CPU


def test_cpu_bf16_plan(monkeypatch):
    """dtype="bfloat16" on a CPU: autocast only with native bf16 that measured faster (or forced); on CUDA always;
    other dtypes and devices as asked."""
    from areal_lite.utils import device

    cpu, bf16, fp32 = torch.device("cpu"), torch.bfloat16, torch.float32
    monkeypatch.delenv(CPU_BF16_ENV, raising=False)
    assert _precision_plan(fp32, cpu) == (fp32, False, "")  # the parity tests' path is never touched
    # a GPU: float32 master weights under bf16 autocast (bf16 weights would round AdamW's 1e-6 steps away)
    dtype, autocast, line = _precision_plan(bf16, torch.device("cuda"))
    assert (dtype, autocast) == (fp32, True) and "on CUDA: float32 weights and optimizer state" in line
    assert _precision_plan(bf16, torch.device("mps")) == (bf16, False, "")  # another device: as asked
    monkeypatch.setattr(device, "cpu_native_bf16", lambda: "AMX")
    monkeypatch.setattr(device, "cpu_bf16_speedup", lambda: 2.0)
    dtype, autocast, line = _precision_plan(bf16, cpu)
    assert (dtype, autocast) == (fp32, True) and "this CPU has AMX" in line and "2.00x as fast" in line
    # The instructions are not enough: where bf16 measured no faster (a Xeon VM: 0.58-0.64x), float32, and why.
    monkeypatch.setattr(device, "cpu_native_bf16", lambda: "AVX-512 BF16")
    for speedup, expected in ((0.6, False), (BF16_MIN_SPEEDUP - 0.01, False), (BF16_MIN_SPEEDUP, True)):
        monkeypatch.setattr(device, "cpu_bf16_speedup", lambda s=speedup: s)
        dtype, autocast, line = _precision_plan(bf16, cpu)
        assert (dtype, autocast) == (fp32, expected), speedup
        assert f"{speedup:.2f}x as fast in bf16" in line and ("training in float32" in line) != expected
    # Forced or forbidden: nothing is measured.
    monkeypatch.setattr(device, "cpu_bf16_speedup", lambda: pytest.fail("measured although the setting decides"))
    monkeypatch.setenv(CPU_BF16_ENV, "1")
    dtype, autocast, line = _precision_plan(bf16, cpu)
    assert (dtype, autocast) == (fp32, True) and f"forced by {CPU_BF16_ENV}=1" in line
    monkeypatch.setenv(CPU_BF16_ENV, "0")
    assert _precision_plan(bf16, cpu)[:2] == (fp32, False)
    monkeypatch.setenv(CPU_BF16_ENV, "yes")
    with pytest.raises(ValueError, match=CPU_BF16_ENV):
        _precision_plan(bf16, cpu)


def test_cpu_bf16_speedup_measures_this_cpu():
    """The measurement behind the plan runs here, whatever the CPU, and gives a ratio of two timings."""
    from areal_lite.utils.device import cpu_bf16_speedup

    torch.manual_seed(5)
    expected_draw = torch.rand(3)
    torch.manual_seed(5)
    speedup = cpu_bf16_speedup(rows=64, width=128, repeats=1)
    assert torch.equal(torch.rand(3), expected_draw)  # the caller's random stream is untouched (the actor seeds first)
    assert math.isfinite(speedup) and speedup > 0
    assert torch.is_autocast_enabled("cpu") is False  # it left no autocast behind
    assert cpu_bf16_speedup(rows=64, width=128, repeats=1) == speedup  # once per process: its actors agree


BF16_RANKS_SCRIPT = """
import sys, torch, torch.distributed as dist
from areal_lite.utils import device
from areal_lite.engine.fsdp_engine import _precision_plan
dist.init_process_group("gloo")
rank = dist.get_rank()
device.cpu_native_bf16 = lambda: "AVX-512 BF16"
device.cpu_bf16_speedup = lambda: 2.0 if rank == 0 else 0.9  # one rank measures bf16 faster, the other slower
dtype, autocast, line = _precision_plan(torch.bfloat16, torch.device("cpu"))
open(sys.argv[1] + str(rank), "w").write(f"{autocast} {line}")
dist.destroy_process_group()
"""


def test_cpu_bf16_plan_is_the_same_on_every_rank(tmp_path):
    """Ranks that measure differently still take one path (a rank autocasting beside one that does not would train
    a different model on each): the slowest measurement decides, here float32 on both."""
    script = tmp_path / "bf16_ranks.py"
    script.write_text(BF16_RANKS_SCRIPT)
    env = child_env()
    env.pop(CPU_BF16_ENV, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    proc = subprocess.run(cmd + [str(tmp_path / "rank")], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [(tmp_path / f"rank{r}").read_text() for r in (0, 1)]
    assert all(line.startswith("False ") and "0.90x as fast" in line for line in lines), lines


def bf16_pair(path: str, vocab: int) -> tuple[FSDPPPOActor, FSDPPPOActor, dict]:
    """(a dtype="bfloat16" actor, a float32 one, a batch with advantages), both with AdamW so there is state."""
    opt = OptimizerConfig(type="adam", lr=1e-3, gradient_clipping=0.0)
    bf = FSDPPPOActor(actor_cfg(path, dtype="bfloat16", optimizer=opt)).initialize()
    fp = FSDPPPOActor(actor_cfg(path, dtype="float32", optimizer=opt)).initialize()
    batch = make_batch(vocab, B=6, seed=12)
    fill_logprobs(fp, batch, noise=0.3)
    g = torch.Generator().manual_seed(7)
    batch["advantages"] = torch.randn(batch["input_ids"].shape, generator=g, dtype=torch.float64) * batch["loss_mask"]
    return bf, fp, batch


def test_cpu_bf16_autocast_keeps_float32_master_weights(tiny_model_path, vocab, monkeypatch, capsys):
    from areal_lite.utils import device

    monkeypatch.setenv(CPU_BF16_ENV, "1")  # the autocast path on any CPU ...
    monkeypatch.setattr(device, "cpu_native_bf16", lambda: "")  # ... and the line that says so, on any CPU too
    bf, fp, batch = bf16_pair(tiny_model_path, vocab)
    assert f"forced by {CPU_BF16_ENV}=1" in capsys.readouterr().out
    got, want = bf.compute_logp(batch), fp.compute_logp(batch)
    # Tolerances: bf16 keeps 8 mantissa bits (relative rounding 2^-9 per op). Measured on this batch (AVX2 CPU):
    # log-probs (|lp| up to 8.7) off by at most 1.7e-3, loss and gradient norm by 0.1% relative. The bounds are
    # ~10x that, for other CPUs' kernels. They only say "close": bf16 *weights* would be about as close (2.1e-3),
    # so the dtype checks below, not these bounds, are what show the master weights stayed float32.
    diff = float((got - want).abs().max())
    assert got.dtype == torch.float32 and 0.0 < diff < 0.02, diff  # > 0: autocast really ran
    stats, ref = bf.ppo_update({k: v.clone() for k, v in batch.items()}), fp.ppo_update(batch)
    assert math.isfinite(stats["loss"]) and stats["skipped"] == 0
    assert stats["loss"] == pytest.approx(ref["loss"], rel=0.01, abs=1e-4)
    assert stats["grad_norm"] == pytest.approx(ref["grad_norm"], rel=0.01)
    assert {p.dtype for p in bf.model.parameters()} == {torch.float32}
    state = [v for s in bf.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    assert state and {v.dtype for v in state} == {torch.float32}  # exp_avg, exp_avg_sq
    bf.destroy()
    fp.destroy()


def test_cpu_bf16_without_native_support_is_float32(tiny_model_path, vocab, monkeypatch, capsys):
    from areal_lite.utils import device

    monkeypatch.delenv(CPU_BF16_ENV, raising=False)
    monkeypatch.setattr(device, "cpu_native_bf16", lambda: "")
    bf, fp, batch = bf16_pair(tiny_model_path, vocab)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 1 and "no AVX-512 BF16/AMX" in lines[0] and "training in float32" in lines[0], lines
    assert torch.equal(bf.compute_logp(batch), fp.compute_logp(batch))
    stats, ref = bf.ppo_update({k: v.clone() for k, v in batch.items()}), fp.ppo_update(batch)
    assert stats == {**ref, "update_time": stats["update_time"]}
    after_bf, after_fp = params(bf), params(fp)
    assert all(torch.equal(after_bf[n], after_fp[n]) for n in after_fp)
    bf.destroy()
    fp.destroy()


def test_same_batch_same_gradients_with_shared_prompts_on_two_threads(tiny_model_path, vocab):
    """GRPO groups share their prompt (and the prompts a chat template's start), whose keys/values each bucket
    gathers: their gradients are summed back in the backward, and on two threads that sum must not depend on the
    threads' timing, or two same-seed runs part after a few steps. Fails with `x[:, idx]` gathers (atomic adds)."""
    # the demo's shape: 4 prompts x 8 samples, 38-token prompts with a 27-token common start, 16 new tokens
    batch = load_bench("update_speed").make_batch(4, 8, 38, 16, vocab, common=27, seed=3)
    actor = FSDPPPOActor(actor_cfg(tiny_model_path, dtype="float32")).initialize(None)
    fill_logprobs(actor, batch)
    actor.compute_advantages(batch)
    grads, threads = [], torch.get_num_threads()
    actor.optimizer.step = lambda: grads.append([p.grad.clone() for p in actor.model.parameters()])
    torch.set_num_threads(2)  # past CI's OMP_NUM_THREADS=1 cap: the race needs two threads
    try:
        for _ in range(4):
            actor.ppo_update({k: v.clone() for k, v in batch.items()})
    finally:
        torch.set_num_threads(threads)
        actor.destroy()
    assert len(grads) == 4
    for other in grads[1:]:
        differ = [i for i, (a, b) in enumerate(zip(grads[0], other)) if not torch.equal(a, b)]
        assert not differ, f"{len(differ)} of {len(other)} parameters' gradients differ between identical updates"


def test_cpu_weights_do_not_point_into_the_checkpoint_file(tiny_model_path):
    """float32 weights loaded on a CPU are views of the safetensors file's private mapping; the actor copies them out
    (else the first AdamW step pays a copy-on-write fault per 4 KB page: 1.9 s for SmolLM2). Tied weights stay tied,
    and the values are the file's."""
    from safetensors.torch import load_file

    from areal_lite.utils.device import file_mappings, in_file_mapping

    actor = FSDPPPOActor(actor_cfg(tiny_model_path, dtype="float32")).initialize()
    model = actor.model
    ranges = file_mappings()
    for name, p in model.named_parameters():
        assert not in_file_mapping(p, ranges), name
    assert model.lm_head.weight is model.model.embed_tokens.weight
    saved = load_file(f"{tiny_model_path}/model.safetensors")
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), saved[name]), name
    ref_model = fsdp_engine._load_model(tiny_model_path, torch.float32, torch.device("cpu"), trainable=False)
    ranges = file_mappings()  # a frozen model keeps reading the file: nothing writes it, and its pages stay shared
    assert any(in_file_mapping(p, ranges) for p in ref_model.parameters())
    actor.destroy()
