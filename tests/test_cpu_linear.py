"""The CPU trainer's LM head on oneDNN (`engine/fsdp_utils/cpu_linear.py`): taken only where measured faster, the
same numbers as `F.linear` up to the product's rounding, the same gradients as its autograd, bit for bit."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from areal_lite.api.cli_args import OptimizerConfig, PPOActorConfig
from areal_lite.engine.fsdp_engine import FSDPPPOActor
from areal_lite.engine.fsdp_utils import cpu_linear


def test_the_onednn_forward_has_linears_numbers_and_its_gradients_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1000, 48, generator=g, requires_grad=True)
    x = torch.randn(2, 7, 48, generator=g, requires_grad=True)
    gy = torch.randn(2, 7, 1000, generator=g)
    y = cpu_linear._OneDNNForward.apply(x, w)
    want = F.linear(x, w)
    assert y.shape == want.shape == (2, 7, 1000)
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)
    gx, gw = torch.autograd.grad(y, (x, w), gy)
    want_gx, want_gw = torch.autograd.grad(want, (x, w), gy)
    assert torch.equal(gx, want_gx) and torch.equal(gw, want_gw)


def test_the_head_takes_onednn_only_at_the_margin_and_only_in_float32_outside_autocast(monkeypatch):
    model = torch.nn.Module()
    model.head = torch.nn.Linear(48, 1000, bias=False)
    model.get_output_embeddings = lambda: model.head
    for speedup, taken in ((cpu_linear.MIN_SPEEDUP, True), (cpu_linear.MIN_SPEEDUP - 0.01, False)):
        model.head.__dict__.pop("forward", None)
        monkeypatch.setattr(cpu_linear, "head_speedup", lambda *shape, s=speedup: s)
        assert cpu_linear.use_onednn_head(model) == speedup
        assert ("forward" in model.head.__dict__) == taken
    x = torch.randn(5, 48)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast and float64 take nn.Linear's own forward
        assert torch.equal(model.head(x), F.linear(x.bfloat16(), model.head.weight.bfloat16()))
    assert torch.equal(model.double().head(x.double()), F.linear(x.double(), model.head.weight))
    model.head.bias = torch.nn.Parameter(torch.zeros(1000))
    assert cpu_linear.use_onednn_head(model) is None  # a head with a bias is left alone


def test_head_speedup_is_measured_once_per_shape():
    cpu_linear.head_speedup.cache_clear()
    first = cpu_linear.head_speedup(1000, 48)
    assert first > 0 and cpu_linear.head_speedup(1000, 48) == first
    assert cpu_linear.head_speedup.cache_info().hits == 1


def test_a_build_whose_onednn_cannot_run_the_product_keeps_mkl(monkeypatch):
    def refuse(x, w):
        raise RuntimeError("mkldnn_linear_pointwise: not supported on this build")

    monkeypatch.setattr(cpu_linear, "_onednn", refuse)
    cpu_linear.head_speedup.cache_clear()
    try:
        assert cpu_linear.head_speedup(1000, 48) == 0.0
        model = torch.nn.Module()
        model.head = torch.nn.Linear(48, 1000, bias=False)
        model.get_output_embeddings = lambda: model.head
        assert cpu_linear.use_onednn_head(model) == 0.0 and "forward" not in model.head.__dict__
    finally:
        cpu_linear.head_speedup.cache_clear()  # the refusal must not stay cached for the tests after this one


def test_a_float32_actor_trains_the_same_with_either_head_kernel(tiny_model_path, monkeypatch):
    """Two float32 actors, the head forced onto each kernel, one SGD step on the same batch: the same loss and
    weights up to float32 rounding (the kernels round the head's product differently)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 400, (4, 12), generator=g)
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, 6:] = 1
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids, dtype=torch.bool), "loss_mask": loss_mask,
             "rewards": torch.tensor([1.0, 0.0, 0.5, 0.2])}  # fmt: skip
    results = []
    for speedup in (2.0, 1.0):
        monkeypatch.setattr(cpu_linear, "head_speedup", lambda *shape, s=speedup: s)
        opt = OptimizerConfig(type="sgd", lr=0.1, gradient_clipping=0.0)
        cfg = PPOActorConfig(path=tiny_model_path, dtype="float32", device="cpu", optimizer=opt, threads=1)
        actor = FSDPPPOActor(cfg).initialize()
        assert ("forward" in actor.model.get_output_embeddings().__dict__) == (speedup > 1)
        b = {k: v.clone() for k, v in batch.items()}
        b["logprobs"] = b["prox_logp"] = actor.compute_logp(b)
        actor.compute_advantages(b)
        stats = actor.ppo_update(b)
        results.append((stats, {n: p.detach().clone() for n, p in actor.model.named_parameters()}))
    (s1, p1), (s2, p2) = results
    torch.testing.assert_close(torch.tensor(s1["loss"]), torch.tensor(s2["loss"]), atol=1e-5, rtol=1e-4)
    for name in p1:
        torch.testing.assert_close(p1[name], p2[name], atol=1e-5, rtol=1e-4, msg=name)
