"""Prompt ids for a turn that continues an earlier completion: `concat_prompt_token_ids_with_parent` (AReaL 1.0.4's
`areal.experimental.openai.client`).

Concat mode trains on one row per conversation, so a child's prompt must extend its parent's ids exactly: the
parent's prompt and generated ids as sampled, then the new messages. The whole conversation is rendered by the
chat template and the new part located by counting EOS tokens: the parent's ids hold k of them, and everything
after the k-th EOS of the rendering is new. The parent's output is taken without its stop tokens plus one EOS, so
an output cut by length or aborted (no EOS) gets the one the template writes there, as part of the child's prompt.

The kit's chat server (`proxy.server`) uses the same count through `ChatTemplate.continue_from`, anchored on the
template's end-of-turn token rather than EOS and with tool rewriting for templates without tool support; the
index of the k-th anchor is one function, `chat_template._kth`.
"""

from __future__ import annotations

from typing import Any, Iterable, List, Mapping, Optional

from areal_lite.experimental.openai.chat_template import _kth
from areal_lite.experimental.openai.types import InteractionWithTokenLogpReward
from areal_lite.utils.hf_utils import apply_chat_template

__all__ = ["concat_prompt_token_ids_with_parent"]


def concat_prompt_token_ids_with_parent(
    message_list: List[dict],
    parent: Optional[InteractionWithTokenLogpReward],
    tokenizer: Any,
    tools: Optional[Iterable[Mapping[str, Any]]] = None,
    extra_body: Mapping[str, Any] = {},  # noqa: B006 -- AReaL's default; read, never mutated
) -> List[int]:
    """The prompt ids of `message_list` after `parent`'s answer (see the module docstring); without a parent, the
    chat template of `message_list` with the generation prompt. `extra_body["chat_template_kwargs"]` goes to the
    template. Raises ValueError for a parent without a model response, RuntimeError when the rendering has fewer
    EOS tokens than the parent's ids (the template dropped or merged a turn)."""
    eos = tokenizer.eos_token_id
    parent_ids: List[int] = []
    messages: List[dict] = []
    if parent is not None:
        resp = parent.model_response
        if resp is None:
            raise ValueError("Parent interaction has no model_response.")
        parent_ids = list(resp.input_tokens) + list(resp.output_tokens_without_stop) + [eos]
        messages += list(parent.messages or []) + list(parent.output_message_list or [])
    messages += list(message_list)
    full = apply_chat_template(
        tokenizer,
        messages,
        tools=tools,
        add_generation_prompt=True,
        tokenize=True,
        **extra_body.get("chat_template_kwargs", {}),
    )
    k = parent_ids.count(eos)
    if k == 0:
        return parent_ids + full
    at = _kth(full, eos, k)
    if at == -1 or at + 1 >= len(full):
        raise RuntimeError(
            f"Failed to align child tokens with parent tokens in concat prompt: the {k}-th EOS of the parent's ids "
            f"is at {at} in the rendered conversation, which has {full.count(eos)} EOS in {len(full)} tokens."
        )
    return parent_ids + full[at + 1 :]
