"""The embedding's gradient, added row by row into the matrix's own gradient instead of through a dense copy.

Design decisions, and why
- Why: autograd gives an embedding lookup a dense [vocab, hidden] gradient, zeros with the looked-up rows added,
  and where the LM head shares the matrix (tied weights: SmolLM2, Qwen2.5 up to 3B) it then adds that whole matrix
  to the LM head's gradient. For SmolLM2 that is two passes over 113 MB to add a few hundred rows, a noticeable
  share of a small model's update (bench/update_speed.py measures the update).
- How (`embedding_inputs`): the trainer's forward passes `inputs_embeds`, looked up from the detached matrix into
  a leaf tensor; a hook on that leaf sums its gradient per distinct token, in the order the lookup's own backward
  sums them, and adds each sum to the matrix's gradient once. With one backward per optimizer step the result is
  bit for bit the gradient autograd builds (the two contributions meet in one addition either way); with several
  micro-batches the additions associate differently, a rounding-level difference.
- The lookup's rules are kept: a `padding_idx` row gets no gradient. Anything this does not reproduce (max_norm,
  scale_grad_by_freq, sparse gradients, a frozen or sharded matrix, a GPU, whose index_add sums duplicates in no
  fixed order) takes the plain `input_ids` path, as does every forward pass without gradients.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Dict

import torch
import torch.nn.functional as F


def _applies(emb: Any) -> bool:
    if not isinstance(emb, torch.nn.Embedding) or emb.max_norm is not None or emb.scale_grad_by_freq or emb.sparse:
        return False
    w = emb.weight
    return w.requires_grad and w.device.type == "cpu" and type(w.data) is torch.Tensor  # a DTensor is sharded


def embedding_inputs(model: torch.nn.Module, ids: torch.Tensor) -> Dict[str, torch.Tensor]:
    """The model keyword for token ids `ids`: `input_ids`, or (while gradients are recorded, where it applies: see the
    module docstring) `inputs_embeds` whose gradient goes straight into the embedding matrix's."""
    emb = model.get_input_embeddings()
    if not torch.is_grad_enabled() or not _applies(emb):
        return {"input_ids": ids}
    weight = emb.weight
    embeds = F.embedding(ids, weight.detach(), emb.padding_idx).requires_grad_()
    embeds.register_hook(partial(_add_rows, weight, ids, emb.padding_idx))
    return {"inputs_embeds": embeds}


@torch.no_grad()
def _add_rows(weight: torch.Tensor, ids: torch.Tensor, padding_idx: Any, grad: torch.Tensor) -> None:
    ids, grad = ids.reshape(-1), grad.reshape(-1, grad.shape[-1])
    if padding_idx is not None:
        keep = ids != padding_idx
        ids, grad = ids[keep], grad[keep]
    tokens, where = torch.unique(ids, return_inverse=True)
    # index_add on a CPU adds the rows of a token in their order, from zero: the sums the lookup's backward makes
    rows = grad.new_zeros(len(tokens), grad.shape[-1]).index_add_(0, where, grad)
    if weight.grad is None:  # an untied matrix, or the LM head's part still to come (it is then added in place)
        weight.grad = torch.zeros_like(weight)
    weight.grad.index_add_(0, tokens, rows)
