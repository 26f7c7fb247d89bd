"""engine.fsdp_utils.packing: packed rows, the packed forward, and AReaL's list of trajectories <-> one batch.

(Micro-batch splitting and packed log-probs equal to per-sequence ones are checked in test_actor.py.)
"""

from __future__ import annotations

import pytest
import torch

from areal_lite.engine.fsdp_utils import packing


def _batch():
    return {
        "input_ids": torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0], [1, 2, 3, 4]], dtype=torch.int32),
        "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool),
        "x": torch.tensor([[0.1, 0.2, 0.3, 9.0], [0.4, 0.5, 9.0, 9.0], [0.6, 0.7, 0.8, 0.9]]),
    }


def test_pack_rows_unpads_and_restarts_positions():
    packed = packing.pack_rows(_batch(), [2, 0], ["x"], torch.device("cpu"))
    assert packed["input_ids"].tolist() == [1, 2, 3, 4, 5, 6, 7] and packed["input_ids"].dtype == torch.long
    assert packed["position_ids"].tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert packed["seq_start"].tolist() == [True, False, False, False, True, False, False]
    torch.testing.assert_close(packed["x"], torch.tensor([0.6, 0.7, 0.8, 0.9, 0.1, 0.2, 0.3]))


def test_packed_forward_equals_one_forward_per_sequence(tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    packing.register_packed_sdpa()
    packing.register_packed_sdpa()  # idempotent
    model.set_attn_implementation(packing.PACKED_SDPA)
    batch = _batch()
    packed = packing.pack_rows(batch, [0, 1, 2], [], torch.device("cpu"))
    with torch.no_grad():
        logits = packing.packed_forward(model, packed)
        keep = torch.tensor([1, 4, 8])
        some = packing.packed_forward(model, packed, keep=keep)
        start = 0
        for i in range(3):
            n = int(batch["attention_mask"][i].sum())
            alone = model(input_ids=batch["input_ids"][i, :n].long()[None]).logits[0]
            torch.testing.assert_close(logits[start : start + n], alone, atol=1e-5, rtol=0)
            start += n
        # a padded batch (no cu_seq_lens) falls through to sdpa with its usual mask
        padded = model(input_ids=batch["input_ids"].long(), attention_mask=batch["attention_mask"].long()).logits
    torch.testing.assert_close(some, logits[keep])
    torch.testing.assert_close(padded[1, :2], logits[3:5], atol=1e-5, rtol=0)


def test_join_and_split_trajectories_round_trip():
    items = [
        {"input_ids": torch.tensor([[1, 2, 3]]).int(), "attention_mask": torch.ones(1, 3, dtype=torch.bool)},
        {
            "input_ids": torch.tensor([[4, 5], [6, 0]], dtype=torch.int32),
            "attention_mask": torch.tensor([[1, 1], [1, 0]], dtype=torch.bool),
        },
    ]
    joined = packing.join_trajectories(items)
    assert joined["input_ids"].dtype == torch.long and joined["input_ids"].shape == (3, 3)
    parts = packing.split_trajectories(joined["input_ids"], items)
    assert [p.tolist() for p in parts] == [[[1, 2, 3]], [[4, 5], [6, 0]]]
    assert [p.tolist() for p in packing.split_trajectories(torch.tensor([7, 8, 9]), items)] == [[7], [8, 9]]
    with pytest.raises(ValueError, match="nothing to train on"):
        packing.join_trajectories([])


def test_as_long_leaves_the_callers_batch_alone():
    batch = {"input_ids": torch.tensor([[1]], dtype=torch.int32), "loss_mask": torch.tensor([[1]], dtype=torch.int32)}
    out = packing.as_long(batch)
    assert out["input_ids"].dtype == out["loss_mask"].dtype == torch.long
    assert batch["input_ids"].dtype == torch.int32
    packing.cast_long(batch)
    assert batch["input_ids"].dtype == torch.long


def test_attention_runs_in_float32_under_a_cpus_bf16_autocast():
    """Under bf16 autocast a CPU's sdpa would get bf16 inputs, and its bf16 backward ran ~5x slower than float32's
    (bench/update_speed.py). The packed attention turns autocast off and computes in float32: exactly what float32
    inputs give without autocast, whatever dtypes the model hands it (rotary embeddings leave query and key float32
    under autocast, the value projection is bf16)."""
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 3, True
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, 6, 7, 8, generator=g),
        torch.randn(1, 2, 7, 8, generator=g),
        torch.randn(1, 2, 7, 8, generator=g),
    )
    cu = torch.tensor([0, 3, 7])
    want, _ = packing.packed_sdpa_attention(module, q, k, v.bfloat16().float(), None, cu_seq_lens_q=cu)
    leaves = [t.clone().requires_grad_() for t in (q, k, v.bfloat16())]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = packing.packed_sdpa_attention(module, *leaves, None, cu_seq_lens_q=cu)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    got.sum().backward()
    assert [t.grad.dtype for t in leaves] == [torch.float32, torch.float32, torch.bfloat16]
