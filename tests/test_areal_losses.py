"""The kit's PPO/SAPO losses and rejection sampling against the real AReaL 1.0.4, on the same random inputs.

`areal_lite.utils.functional.{ppo_actor_loss_fn, sapo_loss_fn, apply_rejection_sampling}` and
`areal_lite.api.cli_args.RejectionSamplingConfig` must be drop-ins for AReaL's: the same parameters and defaults,
the same config fields, checks (exception type and message) and warning, and the same loss, gradient and stats on
padded [B, L] and packed [T] batches for every setting below. One difference is kept on purpose and checked as
such: a dual-clip constant c_clip <= 1 is a ValueError in the kit, a bare `assert` in AReaL (gone under python -O).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import warnings

import pytest
import torch

from areal_lite.api import cli_args as kit_args
from areal_lite.utils import functional as kit


# AReaL's modules come from fixtures, not `pytest.importorskip`: AReaL is installed --no-deps, and a dependency it
# lacks must fail these conformance tests (with the import error), not skip them. `import_areal` (conftest) also
# undoes the OPENAI_* variables AReaL sets at import, which would otherwise leak into every later test.
@pytest.fixture
def areal_args(import_areal):
    """AReaL 1.0.4's `areal.api.cli_args`."""
    return import_areal("areal.api.cli_args")


@pytest.fixture
def areal(import_areal):
    """AReaL 1.0.4's `areal.utils.functional`."""
    return import_areal("areal.utils.functional")


# ------------------------------------------------------------------------------------------------ names and config


@pytest.mark.parametrize("name", ["ppo_actor_loss_fn", "sapo_loss_fn", "apply_rejection_sampling"])
def test_signatures_and_defaults(name, areal):
    ours = inspect.signature(getattr(kit, name)).parameters
    theirs = inspect.signature(getattr(areal, name)).parameters
    assert list(ours) == list(theirs)
    assert [p.default for p in ours.values()] == [p.default for p in theirs.values()]


def test_config_fields_and_defaults(areal, areal_args):
    ours, theirs = (
        dataclasses.fields(kit_args.RejectionSamplingConfig),
        dataclasses.fields(areal_args.RejectionSamplingConfig),
    )
    assert [(f.name, f.default) for f in ours] == [(f.name, f.default) for f in theirs]
    assert [f.metadata.get("choices") for f in ours] == [
        tuple(c) if (c := f.metadata.get("choices")) else None for f in theirs
    ]
    assert [f.name for f in dataclasses.fields(kit.RejectionSamplingResult)] == [
        f.name for f in dataclasses.fields(areal.RejectionSamplingResult)
    ]


BAD_CONFIGS = [
    dict(level="batch"),
    dict(action="drop"),
    dict(metric="kl_k4"),
    dict(agg="median", level="sequence"),
    dict(lower=3.0, upper=2.0),
    dict(metric="ratio", upper=1.0),
    dict(metric="ratio", lower=0.0),
    dict(metric="ratio", lower=-0.5),
    dict(metric="kl_k2", upper=0.0),
    dict(metric="kl_k3", upper=-1.0),
    dict(action="clamp", metric="kl_k1", upper=1.0),
    dict(action="clamp", metric="kl_k3", upper=1.0),
]


@pytest.mark.parametrize("kwargs", BAD_CONFIGS, ids=str)
def test_config_errors_match(kwargs, areal_args):
    with pytest.raises(ValueError) as theirs:
        areal_args.RejectionSamplingConfig(**kwargs)
    with pytest.raises(ValueError) as ours:
        kit_args.RejectionSamplingConfig(**kwargs)
    assert str(ours.value) == str(theirs.value)


GOOD_CONFIGS = [
    dict(),
    dict(action="clamp"),
    dict(action="clamp", lower=0.5, upper=2.0),
    dict(metric="kl_k1", upper=-0.1, lower=-0.5),
    dict(metric="kl_k2", upper=0.3, level="sequence", agg="max"),
    dict(level="token", agg="max"),
    dict(level="token", agg="sum", metric="kl_k3", upper=0.2),
]


@pytest.mark.parametrize("kwargs", GOOD_CONFIGS, ids=str)
def test_config_values_and_warnings_match(kwargs, areal_args):
    with warnings.catch_warnings(record=True) as theirs_w:
        warnings.simplefilter("always")
        theirs = areal_args.RejectionSamplingConfig(**kwargs)
    with warnings.catch_warnings(record=True) as ours_w:
        warnings.simplefilter("always")
        ours = kit_args.RejectionSamplingConfig(**kwargs)
    assert dataclasses.asdict(ours) == dataclasses.asdict(theirs)  # clamp: lower None -> 0.0
    assert [(w.category, str(w.message)) for w in ours_w] == [(w.category, str(w.message)) for w in theirs_w]


# ------------------------------------------------------------------------------------------------ random batches


def _batch(seed: int, packed: bool, dtype=torch.float32):
    """Log-probs with stale tokens, ties-free advantages and a mask with padding (and an empty sequence)."""
    g = torch.Generator().manual_seed(seed)
    shape = (24,) if packed else (4, 6)
    behav = -torch.rand(shape, generator=g) * 3
    prox = behav + torch.randn(shape, generator=g) * 0.6
    logp = prox + torch.randn(shape, generator=g) * 0.4
    adv = torch.randn(shape, generator=g)
    mask = torch.rand(shape, generator=g) > 0.25
    cu = torch.tensor([0, 5, 11, 13, 24], dtype=torch.int32) if packed else None
    if packed:
        mask[11:13] = False
    else:
        mask[2] = False
    return [t.to(dtype) for t in (logp, prox, behav, adv)] + [mask, cu]


def _configs(module):
    cls = module.RejectionSamplingConfig
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [
            None,
            cls(upper=1.5),
            cls(upper=2.0, lower=0.6),
            cls(action="clamp", upper=1.4),
            cls(action="clamp", upper=1.6, lower=0.7),
            cls(level="sequence", upper=1.3),
            cls(level="sequence", agg="sum", upper=3.0, lower=0.2),
            cls(level="sequence", agg="max", upper=2.5),
            cls(level="sequence", action="clamp", upper=1.1, lower=0.8),
            cls(metric="kl_k1", upper=0.3, lower=-0.4),
            cls(metric="kl_k2", upper=0.1),
            cls(metric="kl_k3", upper=0.08),
            cls(metric="kl_k2", level="sequence", agg="mean", upper=0.15),
            cls(metric="kl_k3", level="sequence", agg="max", upper=0.3),
            cls(metric="kl_k1", level="sequence", agg="sum", upper=0.5),
        ]


RS_IDS = [str(c) for c in _configs(kit_args)]


def _assert_same_result(ours, theirs):
    assert ours.loss_mask.dtype == theirs.loss_mask.dtype
    assert torch.equal(ours.loss_mask, theirs.loss_mask)
    torch.testing.assert_close(ours.behave_imp_weight, theirs.behave_imp_weight)
    assert ours.filtered_fraction == pytest.approx(theirs.filtered_fraction)
    assert type(ours.filtered_fraction) is type(theirs.filtered_fraction)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("i", range(1, len(RS_IDS)), ids=RS_IDS[1:])
def test_rejection_sampling_matches(i, packed, areal, areal_args):
    ours_cfg, theirs_cfg = _configs(kit_args)[i], _configs(areal_args)[i]
    for seed in range(3):
        _, prox, behav, _, mask, cu = _batch(seed, packed)
        for m in (mask, mask.float()):  # AReaL's rejection sampling takes a float mask too
            ours = kit.apply_rejection_sampling(prox, behav, m, cu, ours_cfg)
            theirs = areal.apply_rejection_sampling(prox, behav, m, cu, theirs_cfg)
            _assert_same_result(ours, theirs)


def test_rejection_sampling_errors_match(areal, areal_args):
    cfg_k, cfg_a = kit_args.RejectionSamplingConfig(), areal_args.RejectionSamplingConfig()
    seq_k, seq_a = (m.RejectionSamplingConfig(level="sequence") for m in (kit_args, areal_args))
    x = torch.zeros(2, 3)
    cases = [
        ((x, torch.zeros(2, 4), torch.ones(2, 3), None), cfg_k, cfg_a),  # shapes differ
        ((x, x, torch.ones(3, 2), None), cfg_k, cfg_a),
        ((torch.zeros(1, 2, 3),) * 3 + (None,), cfg_k, cfg_a),  # 3-D
        ((torch.zeros(5), torch.zeros(5), torch.ones(5), None), seq_k, seq_a),  # packed without cu_seqlens
    ]
    for args, k, a in cases:
        with pytest.raises(ValueError) as theirs:
            areal.apply_rejection_sampling(*args, a)
        with pytest.raises(ValueError) as ours:
            kit.apply_rejection_sampling(*args, k)
        assert str(ours.value) == str(theirs.value)


def test_non_finite_logprobs_match(areal, areal_args):
    prox = torch.tensor([[0.0, float("-inf"), -1.0, float("-inf")]])
    behav = torch.tensor([[0.0, float("-inf"), float("-inf"), -2.0]])
    for metric, upper in (("ratio", 3.0), ("kl_k2", 0.5)):
        for level in ("token", "sequence"):
            kw = dict(metric=metric, upper=upper, level=level)
            ours = kit.apply_rejection_sampling(
                prox, behav, torch.ones(1, 4), None, kit_args.RejectionSamplingConfig(**kw)
            )
            theirs = areal.apply_rejection_sampling(
                prox, behav, torch.ones(1, 4), None, areal_args.RejectionSamplingConfig(**kw)
            )
            _assert_same_result(ours, theirs)


# ------------------------------------------------------------------------------------------------ the losses


def _run(fn, tensors, **kw):
    logp0, *rest = tensors
    logp = logp0.clone().requires_grad_(True)
    loss, stat = fn(logp, *rest, **kw)
    loss.backward()
    return loss.detach(), logp.grad, stat


def _assert_same_loss(ours, theirs):
    (lo, go, so), (lt, gt, st) = ours, theirs
    assert lo.shape == lt.shape == () and lo.dtype == lt.dtype
    torch.testing.assert_close(lo, lt)
    torch.testing.assert_close(go, gt)
    assert list(so) == list(st)
    for key, value in st.items():
        if isinstance(value, torch.Tensor) and value.dtype == torch.bool:
            assert torch.equal(so[key], value), key
        elif isinstance(value, torch.Tensor):
            torch.testing.assert_close(so[key], value, msg=key)
        else:
            assert so[key] == pytest.approx(value), key


CLIPS = [
    dict(eps_clip=0.2),
    dict(eps_clip=0.2, eps_clip_higher=0.28),
    dict(eps_clip=0.1, c_clip=1.5),
    dict(eps_clip=0.15, eps_clip_higher=0.3, c_clip=3.0),
]


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("clip", CLIPS, ids=str)
def test_ppo_actor_loss_matches(clip, level, packed, areal, areal_args):
    for seed in range(2):
        logp, prox, behav, adv, mask, cu = _batch(seed, packed)
        for rs_k, rs_a in zip(_configs(kit_args), _configs(areal_args)):
            kw = dict(clip, loss_mask=mask, rejection_sampling=None, importance_sampling_level=level, cu_seqlens=cu)
            ours = _run(kit.ppo_actor_loss_fn, (logp, prox, behav, adv), **{**kw, "rejection_sampling": rs_k})
            theirs = _run(areal.ppo_actor_loss_fn, (logp, prox, behav, adv), **{**kw, "rejection_sampling": rs_a})
            _assert_same_loss(ours, theirs)


def test_ppo_actor_loss_in_bfloat16_matches(areal, areal_args):
    logp, prox, behav, adv, mask, _ = _batch(4, False, torch.bfloat16)
    for rs_k, rs_a in zip(_configs(kit_args)[:4], _configs(areal_args)[:4]):
        ours = _run(
            kit.ppo_actor_loss_fn, (logp, prox, behav, adv), eps_clip=0.2, loss_mask=mask, rejection_sampling=rs_k
        )
        theirs = _run(
            areal.ppo_actor_loss_fn, (logp, prox, behav, adv), eps_clip=0.2, loss_mask=mask, rejection_sampling=rs_a
        )
        _assert_same_loss(ours, theirs)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("taus", [(1.0, 1.05), (0.5, 2.0), (4.0, 4.0)], ids=str)
def test_sapo_loss_matches(taus, level, packed, areal):
    for seed in range(2):
        logp, _, behav, adv, mask, cu = _batch(seed, packed)
        kw = dict(tau_pos=taus[0], tau_neg=taus[1], loss_mask=mask, importance_sampling_level=level, cu_seqlens=cu)
        _assert_same_loss(
            _run(kit.sapo_loss_fn, (logp, behav, adv), **kw), _run(areal.sapo_loss_fn, (logp, behav, adv), **kw)
        )


LOSS_ERRORS = [
    ("ppo_actor_loss_fn", dict(eps_clip=0.2, importance_sampling_level="seq"), False),
    ("ppo_actor_loss_fn", dict(eps_clip=0.2, importance_sampling_level="sequence"), True),  # packed, no cu_seqlens
    ("sapo_loss_fn", dict(tau_pos=0.0, tau_neg=1.0), False),
    ("sapo_loss_fn", dict(tau_pos=1.0, tau_neg=-1.0), False),
    ("sapo_loss_fn", dict(tau_pos=1.0, tau_neg=1.0, importance_sampling_level="tok"), False),
    ("sapo_loss_fn", dict(tau_pos=1.0, tau_neg=1.0, importance_sampling_level="sequence"), True),
]


@pytest.mark.parametrize("name,kw,packed", LOSS_ERRORS, ids=[f"{n}-{k}" for n, k, _ in LOSS_ERRORS])
def test_loss_errors_match(name, kw, packed, areal):
    logp, prox, behav, adv, mask, _ = _batch(0, packed)
    args = (logp, prox, behav, adv) if name == "ppo_actor_loss_fn" else (logp, behav, adv)
    with pytest.raises(ValueError) as theirs:
        getattr(areal, name)(*args, loss_mask=mask, **kw)
    with pytest.raises(ValueError) as ours:
        getattr(kit, name)(*args, loss_mask=mask, **kw)
    first_sentence = str(theirs.value).split(". ")[0]  # AReaL's advice after it names its own packing helper
    assert str(ours.value).startswith(first_sentence)


def test_dual_clip_at_most_one_is_refused_on_both_sides(areal):
    """Kept on purpose: AReaL's check is an `assert` (stripped under python -O), the kit's a ValueError."""
    logp, prox, behav, adv, mask, _ = _batch(0, False)
    with pytest.raises(AssertionError):
        areal.ppo_actor_loss_fn(logp, prox, behav, adv, 0.2, mask, c_clip=1.0)
    with pytest.raises(ValueError, match="c_clip must be > 1"):
        kit.ppo_actor_loss_fn(logp, prox, behav, adv, 0.2, mask, c_clip=1.0)


@pytest.mark.parametrize("cap", [None, 1.3])
def test_the_kits_token_loss_is_ppo_actor_loss_fn_per_token(cap, areal, areal_args):
    """`ppo_token_loss` summed over the tokens is `ppo_actor_loss_fn` with the cap as rejection sampling (no cap:
    an infinite one, so every token keeps its behaviour weight), value and gradient."""
    logp, prox, behav, adv, mask, _ = _batch(7, False)
    upper = math.inf if cap is None else cap
    kw = dict(eps_clip=0.2, loss_mask=mask, c_clip=2.0)
    rs_a, rs_k = (m.RejectionSamplingConfig(upper=upper) for m in (areal_args, kit_args))
    theirs = _run(areal.ppo_actor_loss_fn, (logp, prox, behav, adv), rejection_sampling=rs_a, **kw)
    _assert_same_loss(_run(kit.ppo_actor_loss_fn, (logp, prox, behav, adv), rejection_sampling=rs_k, **kw), theirs)
    x = logp.clone().requires_grad_(True)
    per_token, info = kit.ppo_token_loss(x, prox, behav, adv, mask, 0.2, c_clip=2.0, behav_imp_weight_cap=cap)
    loss = per_token.sum() / mask.sum()
    loss.backward()
    torch.testing.assert_close(loss.detach(), theirs[0])
    torch.testing.assert_close(x.grad, theirs[1])
    assert torch.equal(info["capped"], mask & ~theirs[2]["behave_mask"])


def test_a_cap_of_at_most_one_is_refused_when_the_config_is_built():
    """The kit's `behav_imp_weight_cap` is AReaL's `rejection_sampling.upper`, with its check (> 1), at config time."""
    with pytest.raises(kit_args.ConfigError, match="behav_imp_weight_cap must be > 1"):
        kit_args.PPOActorConfig(behav_imp_weight_cap=1.0)
    assert (
        kit_args.PPOActorConfig(rejection_sampling=kit_args.RejectionSamplingConfig(upper=2.0)).behav_imp_weight_cap
        == 2.0
    )


def test_the_weight_cap_rule_is_rejection_samplings_default_rule():
    """`ppo_token_loss`'s `behav_imp_weight_cap` builds `functional._TokenRatioCap` (utils sits below api's configs):
    every field it has equals `RejectionSamplingConfig(upper=cap)`'s."""
    import dataclasses

    from areal_lite.api.cli_args import RejectionSamplingConfig
    from areal_lite.utils.functional import _TokenRatioCap

    cap, config = _TokenRatioCap(upper=3.0), RejectionSamplingConfig(upper=3.0)
    for f in dataclasses.fields(cap):
        assert getattr(cap, f.name) == getattr(config, f.name), f.name
