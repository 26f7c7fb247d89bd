"""`fsdp_utils/embedding_grad.py`: the trainer's embedding gradient, added row by row, is the one autograd builds.

The tiny Qwen2 (tied LM head, float32) runs one packed forward and backward twice, through `inputs_embeds` with the
row-by-row hook and through plain `input_ids`; every parameter's gradient must be the same bit for bit, with token ids
that repeat and include the padding row (which gets no gradient from the lookup), tied and untied.
"""

from __future__ import annotations

import pytest
import torch

from areal_lite.engine.fsdp_utils import embedding_grad, packing
from areal_lite.engine.fsdp_utils.packing import pack_rows, packed_forward


def _model(path: str, tied: bool):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if not tied:
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
        model.config.tie_word_embeddings = False
    packing.register_packed_sdpa()
    model.config._attn_implementation = packing.PACKED_SDPA
    return model.train()


def _grads(model, packed: dict, plain: bool, monkeypatch) -> dict:
    if plain:
        monkeypatch.setattr(packing, "embedding_inputs", lambda m, ids: {"input_ids": ids})
    model.zero_grad(set_to_none=True)
    logits = packed_forward(model, packed)
    targets = packed["input_ids"][1:]
    torch.nn.functional.cross_entropy(logits[:-1], targets).backward()
    monkeypatch.undo()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_row_by_row_gradient_is_autograds_bit_for_bit(tiny_model_path, vocab, tied, monkeypatch):
    model = _model(tiny_model_path, tied)
    pad = model.get_input_embeddings().padding_idx
    assert pad is not None  # the test needs a padding row in the ids
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(10, 40, (n,), generator=g) for n in (9, 7, 12)]  # few distinct ids: many repeats
    rows[1][3] = rows[2][5] = pad
    batch = {
        "input_ids": torch.nn.utils.rnn.pad_sequence(rows, batch_first=True),
        "attention_mask": torch.nn.utils.rnn.pad_sequence([torch.ones_like(r) for r in rows], batch_first=True),
    }
    packed = pack_rows(batch, range(3), [], torch.device("cpu"))
    assert len(packed["input_ids"].unique()) < len(packed["input_ids"])

    calls = []
    real = embedding_grad._add_rows
    monkeypatch.setattr(embedding_grad, "_add_rows", lambda *a: calls.append(1) or real(*a))
    fast = _grads(model, packed, plain=False, monkeypatch=monkeypatch)
    assert calls == [1]  # the hook ran: the gradient came the row-by-row way
    plain = _grads(model, packed, plain=True, monkeypatch=monkeypatch)
    assert fast.keys() == plain.keys()
    for name in plain:
        assert torch.equal(fast[name], plain[name]), name
    if not tied:  # the padding row's gradient is the lookup's: none
        assert not fast["model.embed_tokens.weight"][pad].any()


def test_no_gradients_or_a_frozen_matrix_take_the_input_ids(tiny_model_path):
    model = _model(tiny_model_path, tied=True)
    ids = torch.tensor([[11, 12, 13]])
    with torch.no_grad():
        assert set(embedding_grad.embedding_inputs(model, ids)) == {"input_ids"}
    assert set(embedding_grad.embedding_inputs(model, ids)) == {"inputs_embeds"}
    model.get_input_embeddings().weight.requires_grad_(False)
    assert set(embedding_grad.embedding_inputs(model, ids)) == {"input_ids"}
