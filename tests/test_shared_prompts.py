"""Shared prompts: a GRPO group's prompt runs once per forward pass, and nothing a loss sees changes.

`packing.share_prompts` rewrites a packed row so that sequences with equal prompts keep one copy of it; the actor
uses it in `compute_logp` and in the update (`FSDPPPOActor.share_prompts`, on by default). These tests compare it
with the plain packed row on the tiny float64 model: the layout itself, the logits at every position, and a whole
PPO step (weights, statistics, log-probs) with sharing on and off, for full fine-tuning and LoRA.
"""

from __future__ import annotations

import pytest
import torch
from _bench import load_bench

from areal_lite.api.cli_args import MicroBatchSpec, OptimizerConfig, PPOActorConfig
from areal_lite.engine.fsdp_engine import FSDPPPOActor
from areal_lite.engine.fsdp_utils.packing import (
    pack_rows,
    packed_forward,
    prompt_groups,
    share_prompts,
    shared_prefix_forward,
)
from areal_lite.utils.prefix import common_start


def grouped_batch(vocab: int, seed: int = 0, common: int = 0) -> dict:
    """Two groups of 3 samples sharing a prompt each, one lone prompt, a row without policy tokens, and a
    multi-turn sample (policy tokens, then tool tokens, then policy tokens) inside the first group. With `common`,
    every row begins with the same `common` tokens (a chat template's system prompt)."""
    g = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list:
        return torch.randint(10, vocab, (n,), generator=g).tolist()

    start = rand(common)
    rows = []  # (token ids, loss mask)
    for prompt_len, n in ((5, 3), (7, 3), (4, 1)):
        prompt = start + rand(prompt_len)
        prompt_len += common
        for j in range(n):
            completion = rand(2 + j)
            rows.append((prompt + completion, [0] * prompt_len + [1] * len(completion)))
    ids, lm = rows[1]
    rows[1] = (ids + rand(3) + rand(2), lm + [0] * 3 + [1] * 2)  # a tool result, then the answer
    rows.append((start + rand(6), [0] * (common + 6)))  # nothing to train on
    L = max(len(r[0]) for r in rows)
    B = len(rows)
    batch = {
        "input_ids": torch.zeros(B, L, dtype=torch.long),
        "attention_mask": torch.zeros(B, L, dtype=torch.bool),
        "loss_mask": torch.zeros(B, L, dtype=torch.long),
        "rewards": torch.randint(0, 2, (B,), generator=g).double(),
    }
    for i, (ids, lm) in enumerate(rows):
        batch["input_ids"][i, : len(ids)] = torch.tensor(ids)
        batch["attention_mask"][i, : len(ids)] = True
        batch["loss_mask"][i, : len(ids)] = torch.tensor(lm)
    return batch


def packed_of(batch: dict) -> dict:
    return pack_rows(batch, list(range(batch["input_ids"].shape[0])), ["loss_mask"], torch.device("cpu"))


def test_layout_keeps_one_copy_of_each_prompt(vocab):
    batch = grouped_batch(vocab)
    packed = packed_of(batch)
    row = share_prompts(packed, packed["loss_mask"].bool())
    T = packed["input_ids"].shape[0]
    # 5 + 7 + 4 prompt tokens once, every completion but its last token (whose output nothing reads), the
    # policy-free row whole (its "prompt")
    completions = int(batch["attention_mask"].sum()) - (3 * 5 + 3 * 7 + 4 + 6)
    assert row.input_ids.shape[0] == 5 + 7 + 4 + 6 + completions - 7 < T
    # 4 prompts (one is the policy-free row), 7 completions, each completion attending to its prompt
    assert [bucket.q_idx.shape[0] for bucket in row.buckets] == [4, 7]
    assert sorted(row.out_idx.tolist()) == sorted(set(row.out_idx.tolist()))  # each output read once
    # every token but a sequence's first has a predictor, and it predicts the same token id position-wise
    starts = packed["seq_start"]
    assert bool((row.pred_of[starts] == -1).all()) and bool((row.pred_of[~starts] >= 0).all())
    assert torch.equal(row.position_ids[row.pred_of[~starts]], packed["position_ids"][~starts] - 1)


def test_layout_keeps_one_copy_of_the_prompts_common_start(vocab):
    batch = grouped_batch(vocab, common=20)
    packed = packed_of(batch)
    row = share_prompts(packed, packed["loss_mask"].bool())
    completions = int(batch["attention_mask"].sum()) - (3 * 25 + 3 * 27 + 24 + 26)
    assert row.input_ids.shape[0] == 20 + 5 + 7 + 4 + 6 + completions - 7
    # the common start, then 4 prompts' rests over it, then 7 completions over their whole prompts
    assert [bucket.q_idx.shape[0] for bucket in row.buckets] == [1, 4, 7]
    assert len(set(row.out_idx.tolist())) == len(row.out_idx)  # each output read once
    starts = packed["seq_start"]
    assert bool((row.pred_of[starts] == -1).all()) and bool((row.pred_of[~starts] >= 0).all())
    assert torch.equal(row.position_ids[row.pred_of[~starts]], packed["position_ids"][~starts] - 1)


def test_common_start():
    a, b, c = (1, 2, 3, 4, 5), (1, 2, 3, 9), (1, 2, 7)
    assert common_start([a, b], min_saved=1) == 3 and common_start([a, b, c], min_saved=1) == 2
    assert common_start([a, a[:2] + (8,)], min_saved=1) == 2
    assert common_start([a, b], min_saved=4) == 0  # 3 tokens saved, fewer than asked: not worth a third call
    assert common_start([a], min_saved=0) == 0  # one prompt: nothing to share
    assert common_start([(1, 2), (1, 2, 3)], min_saved=0) == 1  # every prompt keeps a token of its own


def test_nothing_shared_gives_none(vocab):
    batch = grouped_batch(vocab)
    lone = [0, 3, 6, 7]  # one sample of each prompt, and the policy-free row
    packed = pack_rows(batch, lone, ["loss_mask"], torch.device("cpu"))
    assert share_prompts(packed, packed["loss_mask"].bool()) is None


@pytest.mark.parametrize("common", [0, 20], ids=["prompts", "prompts-and-start"])
def test_logits_at_every_position_equal_the_plain_row(tiny_model_path, vocab, common):
    actor = FSDPPPOActor(actor_cfg(tiny_model_path)).initialize()
    packed = packed_of(grouped_batch(vocab, common=common))
    row = share_prompts(packed, packed["loss_mask"].bool())
    targets = torch.nonzero(~packed["seq_start"]).flatten()
    with torch.no_grad():
        plain = packed_forward(actor.model, packed, keep=targets - 1)
        shared = shared_prefix_forward(actor.model, row, row.pred_of[targets])
    torch.testing.assert_close(shared, plain, rtol=1e-10, atol=1e-10)
    actor.destroy()


def test_a_one_token_completion_runs_no_remainder(tiny_model_path, vocab):
    # A completion of one token is predicted by its prompt's last token: with its last token left out, its
    # remainder is empty and gets no attention segment; its log-prob is still the plain row's.
    batch = grouped_batch(vocab)
    keep = [0, 1, 2, 7]  # the first group (completions of 2, 3+5 and 4 tokens) and the policy-free row
    sub = {k: v[keep].clone() for k, v in batch.items()}
    ends = sub["attention_mask"].sum(1)
    sub["attention_mask"][0, int(ends[0]) - 1 :] = False  # the first completion cut to one token
    sub["loss_mask"][0, int(ends[0]) - 1 :] = 0
    packed = packed_of(sub)
    row = share_prompts(packed, packed["loss_mask"].bool())
    assert [bucket.q_idx.shape[0] for bucket in row.buckets] == [2, 2]  # 2 prompts; 2 remainders, not 3
    targets = torch.nonzero(~packed["seq_start"]).flatten()
    actor = FSDPPPOActor(actor_cfg(tiny_model_path)).initialize()
    with torch.no_grad():
        plain = packed_forward(actor.model, packed, keep=targets - 1)
        shared = shared_prefix_forward(actor.model, row, row.pred_of[targets])
    torch.testing.assert_close(shared, plain, rtol=1e-10, atol=1e-10)
    actor.destroy()


def actor_cfg(path: str, dtype: str = "float64", **kw) -> PPOActorConfig:
    # SGD with lr 1 and no clipping: the weights' change is the gradient itself
    opt = OptimizerConfig(type="sgd", lr=1.0, gradient_clipping=0.0)
    return PPOActorConfig(path=path, dtype=dtype, device="cpu", optimizer=opt, threads=1, **kw)


def ppo_step(path: str, batch: dict, share: bool, monkeypatch, **kw) -> tuple:
    """compute_logp, then one PPO step: (log-probs, stats, initial and final weights, shared forwards in the step)."""
    import areal_lite.engine.fsdp_engine as fsdp_engine

    actor = FSDPPPOActor(actor_cfg(path, **kw)).initialize()
    actor.share_prompts = share
    batch = {k: v.clone() for k, v in batch.items()}
    logp = actor.compute_logp(batch)
    g = torch.Generator().manual_seed(3)
    batch["logprobs"] = torch.where(batch["loss_mask"].bool(), logp + 0.3 * torch.randn(logp.shape, generator=g), 0)
    actor.compute_advantages(batch)
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return shared_prefix_forward(*args, **kwargs)

    monkeypatch.setattr(fsdp_engine, "shared_prefix_forward", counted)
    before = {n: p.detach().clone() for n, p in actor.model.named_parameters() if p.requires_grad}
    stats = actor.ppo_update(batch)
    after = {n: p.detach().clone() for n, p in actor.model.named_parameters() if p.requires_grad}
    monkeypatch.undo()
    actor.destroy()
    return logp, stats, before, after, len(calls)


@pytest.mark.parametrize("lora,common", [(False, 0), (True, 0), (False, 20)], ids=["full", "lora", "full-start"])
def test_a_ppo_step_is_the_same_with_and_without_sharing(tiny_model_path, vocab, lora, common, monkeypatch):
    kw = dict(use_lora=True, lora_rank=4, lora_alpha=8) if lora else {}
    batch = grouped_batch(vocab, common=common)
    logp_a, stats_a, before, after_a, shared_a = ppo_step(tiny_model_path, batch, True, monkeypatch, **kw)
    logp_b, stats_b, _, after_b, shared_b = ppo_step(tiny_model_path, batch, False, monkeypatch, **kw)
    assert (shared_a, shared_b) == (1, 0)  # one micro-batch, its prompts shared only where asked
    torch.testing.assert_close(logp_a, logp_b, rtol=1e-10, atol=1e-10)
    for key in ("loss", "approx_kl", "clip_frac", "entropy", "grad_norm", "n_tokens"):
        assert stats_a[key] == pytest.approx(stats_b[key], rel=1e-6, abs=1e-9), key
    assert after_a.keys() == after_b.keys() and after_a
    assert any(not torch.equal(before[n], after_a[n]) for n in before)  # the step moved the weights
    for name in after_a:
        # RMSNorm computes in float32 even in a float64 model, and the shared prompt sums its samples'
        # gradients in another order: agreement is to float32 rounding, far below the step itself
        torch.testing.assert_close(after_a[name], after_b[name], rtol=1e-6, atol=1e-7, msg=name)


def test_prompt_groups_keep_groups_whole_and_cut_oversize_ones():
    a, b = (1, 2, 3), (4, 5)
    prompts, lengths = [a, b, a, a, b], [5, 4, 6, 7, 3]
    # a: prompt 3 + tails 2, 3, 4; b: prompt 2 + tails 2, 1
    assert prompt_groups(prompts, lengths, budget=100) == [([0, 2, 3], 12), ([1, 4], 5)]
    # a's 12 shared tokens exceed 8: cut into parts that fit, each with its own prompt copy
    assert prompt_groups(prompts, lengths, budget=8) == [([0, 2], 8), ([3], 7), ([1, 4], 5)]
    assert prompt_groups(prompts, lengths, budget=1) == [([0], 5), ([2], 6), ([3], 7), ([1], 4), ([4], 3)]


def test_microbatches_keep_each_group_together_and_give_the_same_step(tiny_model_path, vocab, monkeypatch):
    batch = grouped_batch(vocab)
    tight = MicroBatchSpec(max_tokens_per_mb=30)  # each group fits, the two groups together do not
    actor = FSDPPPOActor(actor_cfg(tiny_model_path, mb_spec=tight)).initialize()
    mbs = actor._microbatches(batch, range(batch["input_ids"].shape[0]))
    actor.destroy()
    # shared sizes: group 0 is 19 tokens, group 1 16, the lone prompt 6, the policy-free row 6
    assert len(mbs) == 2 and all(any(set(group) <= set(mb) for mb in mbs) for group in ([0, 1, 2], [3, 4, 5]))
    _, stats_a, _, after_a, _ = ppo_step(tiny_model_path, batch, True, monkeypatch, mb_spec=tight)
    _, stats_b, _, after_b, _ = ppo_step(tiny_model_path, batch, False, monkeypatch)
    assert stats_a["loss"] == pytest.approx(stats_b["loss"], rel=1e-6)
    for name in after_a:
        torch.testing.assert_close(after_a[name], after_b[name], rtol=1e-6, atol=1e-7, msg=name)


def test_a_shared_prompt_end_gets_the_same_gradient_on_two_threads(tiny_model_path, vocab):
    """A group's prompt end predicts each sample's first token, so the positions whose logits a shared row keeps
    repeat it. Picked by the model's own indexing, its gradients would be summed with parallel atomic adds, in an
    order that changes from run to run on two threads: the same batch would give other weights, and two same-seed
    runs would part. `shared_prefix_forward` picks each position once; 40 samples of 16 tokens make indexing's
    backward large enough for two threads, float32 (a float64 index_put sums in order anyway)."""
    batch = load_bench("update_speed").make_batch(1, 40, 38, 16, vocab, seed=0)
    packed = packed_of(batch)
    row = share_prompts(packed, packed["loss_mask"].bool())
    keep = row.pred_of[torch.nonzero(packed["loss_mask"]).flatten()]
    assert len(keep.unique()) == len(keep) - 39  # the prompt end, once per sample
    actor = FSDPPPOActor(actor_cfg(tiny_model_path, dtype="float32")).initialize()
    weights = torch.randn(len(keep), vocab, generator=torch.Generator().manual_seed(1))
    grads, saved = [], torch.get_num_threads()
    torch.set_num_threads(2)  # past CI's OMP_NUM_THREADS=1 cap: the race needs two threads
    try:
        for _ in range(8):
            actor.model.zero_grad(set_to_none=True)
            (shared_prefix_forward(actor.model, row, keep) * weights).sum().backward()
            grads.append([p.grad.clone() for p in actor.model.parameters()])
    finally:
        torch.set_num_threads(saved)
        actor.destroy()
    for other in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[0], other))
