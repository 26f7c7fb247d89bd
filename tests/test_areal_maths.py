"""The kit's advantage normalisation against AReaL 1.0.4's own `areal.utils.data.Normalization`, on random batches,
for every mean/std level, leave-one-out and unbiased setting (1e-6), and the constant group that used to blow up.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from areal_lite.api.cli_args import NormConfig
from areal_lite.utils.functional import normalize

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
    areal_cfg = AReaLNormConfig(
        mean_level=level.get(cfg.mean_level, cfg.mean_level),
        std_level=level.get(cfg.std_level, cfg.std_level),
        mean_leave1out=cfg.mean_leave1out,
        std_unbiased=cfg.std_unbiased,
        eps=cfg.eps,
        group_size=cfg.group_size,
    )
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


# ------------------------------------------------------------------------------------------------ the PPO loss


def _batch(seed, B=4, L=9):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, L, generator=g) > 0.3
    behav = -torch.rand(B, L, generator=g, dtype=torch.float64) * 3
    prox = behav + torch.randn(B, L, generator=g, dtype=torch.float64) * 0.3
    logp0 = prox + torch.randn(B, L, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(B, L, generator=g, dtype=torch.float64)
    return mask, behav, prox, logp0, adv


def _ours(logp0, prox, behav, adv, mask, **kw):
    from areal_lite.utils.functional import ppo_token_loss

    logp = logp0.clone().requires_grad_(True)
    per_token, _ = ppo_token_loss(logp, prox, behav, adv, mask, **kw)
    loss = per_token.sum() / mask.sum().clamp(min=1)
    loss.backward()
    return loss.detach(), logp.grad


def _theirs(logp0, prox, behav, adv, mask, rejection_sampling=None, **kw):
    from areal.utils.functional import ppo_actor_loss_fn

    logp = logp0.clone().requires_grad_(True)
    loss, _ = ppo_actor_loss_fn(logp, prox, behav, adv, loss_mask=mask, rejection_sampling=rejection_sampling, **kw)
    loss.backward()
    return loss.detach(), logp.grad


CLIPS = [dict(eps_clip=0.2), dict(eps_clip=0.2, eps_clip_higher=0.28), dict(eps_clip=0.2, c_clip=3.0)]


@pytest.mark.parametrize("clip", CLIPS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_and_gradient_equal_areals_without_behaviour_weight(clip, seed):
    """Plain PPO (use_decoupled_loss=False: the behaviour policy is the proximal one) on both sides."""
    mask, behav, prox, logp0, adv = _batch(seed)
    ours = _ours(logp0, behav, behav, adv, mask, use_decoupled_loss=False, **clip)
    theirs = _theirs(logp0, behav, behav, adv, mask, **clip)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decoupled_loss_with_a_cap_equals_areals_rejection_sampling(seed):
    """The kit's `behav_imp_weight_cap` is AReaL's `rejection_sampling` (token level, mask above the cap)."""
    from areal.api.cli_args import RejectionSamplingConfig

    mask, behav, prox, logp0, adv = _batch(seed)
    ours = _ours(logp0, prox, behav, adv, mask, eps_clip=0.2, behav_imp_weight_cap=1.3)
    rs = RejectionSamplingConfig(level="token", action="mask", metric="ratio", upper=1.3)
    theirs = _theirs(logp0, prox, behav, adv, mask, rejection_sampling=rs, eps_clip=0.2)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_decoupled_loss_without_a_cap_differs_from_areal_by_the_behaviour_weight():
    """A documented difference: with no cap configured AReaL applies no behaviour weight exp(prox - behav), the kit
    still does (decoupled PPO's formula; a cap only drops the extreme tokens). With the weight put back, equal."""
    mask, behav, prox, logp0, adv = _batch(5)
    ours, _ = _ours(logp0, prox, behav, adv, mask, eps_clip=0.2)
    theirs, _ = _theirs(logp0, prox, behav, adv, mask, eps_clip=0.2)
    assert not torch.allclose(ours, theirs)
    weighted, _ = _theirs(logp0, prox, behav, adv * torch.exp(prox - behav), mask, eps_clip=0.2)
    torch.testing.assert_close(ours, weighted, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimates_equal_areals_clamp_included(estimator):
    from areal.utils.data import KLEstimator

    from areal_lite.utils.functional import kl_estimate

    g = torch.Generator().manual_seed(7)
    logp = -torch.rand(64, generator=g) * 20  # differences up to 20 nats: the [-10, 10] clamp matters
    ref = -torch.rand(64, generator=g) * 20
    torch.testing.assert_close(
        kl_estimate(logp, ref, estimator), KLEstimator(estimator)(logp, ref), atol=1e-6, rtol=1e-6
    )


# ------------------------------------------------------------------------------------------------ advantages


def _advantages_both_sides(loss_mask, attention_mask, rewards):
    from areal.api.cli_args import NormConfig as AReaLNormConfig
    from areal.api.cli_args import PPOActorConfig as AReaLPPOActorConfig
    from areal.trainer.ppo.actor import PPOActor as AReaLPPOActor

    from areal_lite.api.cli_args import PPOActorConfig
    from areal_lite.engine.fsdp_engine import FSDPPPOActor

    B, L = loss_mask.shape
    batch = dict(
        input_ids=torch.arange(B * L).view(B, L).int(),
        loss_mask=loss_mask.int(),
        attention_mask=attention_mask.bool(),
        logprobs=torch.zeros(B, L),
        rewards=rewards,
        versions=torch.zeros(B, L, dtype=torch.int32),
    )
    norm = dict(mean_level="group", std_level="group", group_size=B)
    theirs_cfg = AReaLPPOActorConfig(
        experiment_name="x",
        trial_name="y",
        path="unused",
        kl_ctl=0.0,
        use_decoupled_loss=False,
        recompute_logprob=False,
        reward_norm=AReaLNormConfig(**norm),
        adv_norm=None,
    )
    theirs = AReaLPPOActor(theirs_cfg, engine=None)._compute_advantages(dict(batch))["advantages"]
    ours_batch = dict(batch)
    FSDPPPOActor(PPOActorConfig(path="unused", reward_norm=NormConfig(**norm), group_size=B)).compute_advantages(
        ours_batch
    )
    # AReaL's position t holds the advantage of token t + 1 (rolled); the kit's holds token t's own
    return ours_batch["advantages"], torch.roll(theirs, shifts=1, dims=-1)


def test_grpo_advantages_equal_areals_on_generated_tokens():
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1, 0, 0], [0, 0, 0, 1, 1, 0, 0, 0]])
    attention = torch.tensor([[1] * 7 + [0], [1] * 6 + [0] * 2, [1] * 5 + [0] * 3])  # each row ends on its output
    ours, theirs = _advantages_both_sides(loss_mask, attention, torch.tensor([1.0, 0.0, 0.5]))
    generated = loss_mask.bool()
    torch.testing.assert_close(ours[generated], theirs[generated].to(ours.dtype), atol=1e-6, rtol=1e-6)


def test_a_row_ending_in_observation_tokens_gets_no_advantage_in_areal():
    """A documented difference: AReaL puts the reward on the row's last position; when that is not a generated
    token (the episode ended on a tool result) its masked GAE drops it and every token of the row gets advantage 0.
    The kit spreads the reward over the generated tokens wherever the row ends."""
    loss_mask = torch.tensor([[0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0]])
    attention = torch.tensor([[1] * 6, [1] * 5 + [0]])  # row 0 ends with two observation tokens
    ours, theirs = _advantages_both_sides(loss_mask, attention, torch.tensor([1.0, 0.0]))
    generated = loss_mask.bool()
    assert (theirs[0][generated[0]] == 0).all() and (ours[0][generated[0]] > 0.5).all()
    torch.testing.assert_close(ours[1][generated[1]], theirs[1][generated[1]].to(ours.dtype), atol=1e-6, rtol=1e-6)


def test_a_list_of_trajectories_as_rollout_batch_returns_it_gets_areals_advantages():
    """The notebooks' training cells pass AReaL's list of trajectories (rows of unequal length), the one input
    AReaL 1.0.4's public compute_advantages takes, and write `data = actor.compute_advantages(data)`: AReaL returns
    new dicts (its input unchanged), the kit updates them in place and returns the same list. Same advantages."""
    from areal.api.cli_args import NormConfig as AReaLNormConfig
    from areal.api.cli_args import PPOActorConfig as AReaLPPOActorConfig
    from areal.trainer.ppo.actor import PPOActor as AReaLPPOActor

    from areal_lite.api.cli_args import PPOActorConfig
    from areal_lite.engine.fsdp_engine import FSDPPPOActor

    def trajectory(prompt: int, answers: list[int], rewards: list[float]) -> dict:
        L = prompt + max(answers) + 1
        loss = torch.tensor([[0] * prompt + [1] * n + [0] * (L - prompt - n) for n in answers])
        attention = torch.tensor([[1] * (prompt + n) + [0] * (L - prompt - n) for n in answers])
        return dict(
            input_ids=torch.arange(len(answers) * L).view(-1, L).int(),
            loss_mask=loss.int(),
            attention_mask=attention.bool(),
            logprobs=torch.zeros(len(answers), L),
            rewards=torch.tensor(rewards),
            versions=torch.zeros(len(answers), L, dtype=torch.int32),
        )

    def trajectories() -> list[dict]:  # two groups of 2, as rollout_batch(group_size=2) returns them
        return [trajectory(3, [4, 2], [1.0, 0.0]), trajectory(5, [3, 3], [0.5, 0.0])]

    norm = dict(mean_level="group", std_level="group", group_size=2)
    areal_actor = AReaLPPOActor(
        AReaLPPOActorConfig(experiment_name="x", trial_name="y", path="unused", kl_ctl=0.0, use_decoupled_loss=False,
                            recompute_logprob=False, reward_norm=AReaLNormConfig(**norm), adv_norm=None),
        engine=None,
    )  # fmt: skip
    with pytest.raises(AssertionError, match="Expected list"):  # one dict, the kit's other form: AReaL refuses it
        areal_actor.compute_advantages(trajectories()[0])
    given = trajectories()
    theirs = areal_actor.compute_advantages(given)
    assert "advantages" not in given[0] and all("advantages" in t for t in theirs)
    kit_actor = FSDPPPOActor(PPOActorConfig(path="unused", reward_norm=NormConfig(**norm), group_size=2))
    ours_given = trajectories()
    ours = kit_actor.compute_advantages(ours_given)
    assert ours is ours_given and all("advantages" in t for t in ours)
    for o, t in zip(ours, theirs):
        generated = o["loss_mask"].bool()
        t_adv = torch.roll(t["advantages"], shifts=1, dims=-1)  # AReaL's position t holds token t + 1's
        torch.testing.assert_close(o["advantages"][generated], t_adv[generated].to(o["advantages"].dtype))


# ------------------------------------------------------------------------------------------------ one PPO step

AREAL_ACTOR = r"""
import os, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[3], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import torch
from areal.api.cli_args import OptimizerConfig, PPOActorConfig
from areal.api.io_struct import FinetuneSpec
from areal.engine.fsdp_engine import FSDPPPOActor

# One process for every job (AReaL's import and process group are most of its time): argv[2] lists
# (batch file, result file) pairs; a one-row batch also takes a PPO step, so those come last.
jobs = torch.load(sys.argv[2])
# No clipping (AReaL reads gradient_clipping=0 as max-norm 0, a zero update; the kit as "off").
opt = OptimizerConfig(type="sgd", lr=0.5, weight_decay=0.0, warmup_steps_proportion=0.0, gradient_clipping=1e9)
cfg = PPOActorConfig(experiment_name="x", trial_name="y", path=sys.argv[1], dtype="float32", backend="fsdp:d1",
                     attn_impl="sdpa", ppo_n_minibatches=1, kl_ctl=0.0, use_decoupled_loss=False,
                     recompute_logprob=False, optimizer=opt, reward_norm=None, adv_norm=None)
actor = FSDPPPOActor(config=cfg)
actor.create_process_group()
actor.initialize(None, FinetuneSpec(1, 8, 1))
for batch_path, out_path in jobs:
    batch = torch.load(batch_path)
    logp = actor.compute_logp([dict(batch)])[0]
    if batch["input_ids"].shape[0] == 1:
        actor.ppo_update(actor.compute_advantages([batch]))
    state = {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for n, p in actor.model.named_parameters()}
    torch.save({"logp": logp, "weights": {n: t.detach().cpu().clone() for n, t in state.items()}}, out_path)
"""


def _kit_actor(tiny_model_path):
    from areal_lite.api.cli_args import OptimizerConfig, PPOActorConfig
    from areal_lite.api.io_struct import FinetuneSpec
    from areal_lite.engine.fsdp_engine import FSDPPPOActor

    opt = OptimizerConfig(type="sgd", lr=0.5, gradient_clipping=1e9)
    actor = FSDPPPOActor(
        PPOActorConfig(
            path=tiny_model_path,
            dtype="float32",
            device="cpu",
            threads=1,
            optimizer=opt,
            use_decoupled_loss=False,
            recompute_logprob=False,
        )
    )
    return actor.initialize(None, FinetuneSpec(1, 8, 1))


def _batch_for(actor, rows):
    g = torch.Generator().manual_seed(0)
    L = 12
    batch = dict(
        input_ids=torch.randint(5, 200, (rows, L), generator=g).int(),
        loss_mask=torch.tensor([[0] * 4 + [1] * 8, [0] * 5 + [1] * 7][:rows], dtype=torch.int32),
        attention_mask=torch.ones(rows, L, dtype=torch.bool),
        versions=torch.zeros(rows, L, dtype=torch.int32),
        rewards=torch.tensor([1.0, 0.0][:rows]),
    )
    # Behaviour log-probs = the model's own (a fresh synchronous step: ratio 1), on generated tokens only.
    batch["logprobs"] = (actor.compute_logp(batch).float() * batch["loss_mask"]).detach()
    return batch


@pytest.fixture(scope="module")
def areal_results(tiny_model_path, tmp_path_factory):
    """AReaL's actor on a two-row batch (log-probs only), then on a one-row batch (log-probs and one PPO step), in one
    subprocess; returns {rows: (batch, AReaL's result)}. The batches come from a fresh kit actor (its log-probs are
    the behaviour log-probs), so each test's own fresh actor starts from the same weights."""
    import subprocess
    import sys

    from areal_lite.kit.server.procs import find_free_port

    tmp = tmp_path_factory.mktemp("areal-actor")
    kit = _kit_actor(tiny_model_path)
    batches = {rows: _batch_for(kit, rows=rows) for rows in (2, 1)}  # the PPO step (one row) last
    kit.destroy()
    jobs = []
    for rows, batch in batches.items():
        torch.save(batch, tmp / f"batch{rows}.pt")
        jobs.append((str(tmp / f"batch{rows}.pt"), str(tmp / f"areal{rows}.pt")))
    torch.save(jobs, tmp / "jobs.pt")
    proc = subprocess.run(
        [sys.executable, "-c", AREAL_ACTOR, tiny_model_path, str(tmp / "jobs.pt"), str(find_free_port())],
        capture_output=True,
        text=True,
        timeout=600,
        # AReaL torch.compiles its log-prob gather (log_softmax, then gather); on a CPU that builds C++ kernels, 20-40 s
        # of a 2-core CI machine's empty cache, for the same numbers as the eager ops (bit for bit on this model):
        # the maths compared here are AReaL's either way.
        env={**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {rows: (batch, torch.load(tmp / f"areal{rows}.pt")) for rows, batch in batches.items()}


def test_one_ppo_step_equals_areals_fsdp_actor_on_cpu(tiny_model_path, areal_results):
    """AReaL 1.0.4's own FSDP PPO actor runs on CPU (gloo, one process, `attn_impl="sdpa"`). One step of it and of
    the kit's actor on the same model, trajectory and settings (plain PPO, SGD: the update is the gradient) give the
    same weights: loss and gradient agree end to end."""
    ours = _kit_actor(tiny_model_path)
    batch, theirs = areal_results[1]
    theirs = theirs["weights"]
    before = {n: p.detach().clone() for n, p in ours.model.named_parameters()}
    ours.compute_advantages(batch)
    ours.ppo_update(batch)
    moved = 0
    for name, p in ours.model.named_parameters():
        torch.testing.assert_close(p.detach(), theirs[name], atol=1e-5, rtol=1e-4)
        moved += int(not torch.equal(p.detach(), before[name]))
    assert moved > 0  # the step did something on both sides
    ours.destroy()


def test_areals_cpu_actor_mixes_packed_sequences_and_the_kits_does_not(tiny_model_path, areal_results):
    """Why the step above uses one row: on CPU AReaL 1.0.4's FSDP actor packs a batch's rows into one sequence and
    its "sdpa" attention does not stop at their boundaries (only flash-attention's varlen kernel does, GPU only), so
    every row after the first is scored with the previous rows in context. The kit's packed attention is masked
    per sequence and equals scoring each row alone."""
    from transformers import AutoModelForCausalLM

    ours = _kit_actor(tiny_model_path)
    batch, theirs = areal_results[2]
    theirs = torch.roll(theirs["logp"], shifts=1, dims=-1)  # AReaL: t -> t+1
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    ids = batch["input_ids"][1:2].long()
    alone = torch.log_softmax(model(input_ids=ids).logits.float(), -1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
    torch.testing.assert_close(
        batch["logprobs"][1, 1:][batch["loss_mask"][1, 1:].bool()],
        alone[batch["loss_mask"][1, 1:].bool()],
        atol=1e-5,
        rtol=1e-5,
    )
    torch.testing.assert_close(
        theirs[0, 1:], ours.compute_logp(batch)[0, 1:].to(batch["logprobs"]), atol=1e-5, rtol=1e-5
    )  # the first row agrees
    assert (theirs[1, 1:] - alone).abs().max() > 1e-2  # the second does not
    ours.destroy()
