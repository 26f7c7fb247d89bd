"""Tokenizer helpers: AReaL 1.0.4's `areal.utils.hf_utils` (`load_hf_tokenizer`, `apply_chat_template`) and the kit's.

- `load_hf_tokenizer`: a tokenizer by path or hub id, cached, with pad = EOS when it has no pad token;
- `apply_chat_template`: the chat template as `list[int]` when tokenized, whatever transformers returns;
- `chat_prompt_ids`: `apply_chat_template` with the generation prompt, as `list[int]`.
- `chat_turn_fragments`: the tokens between two turns, pre-tokenized once from the chat template as two fragments,
  the end-of-turn tokens that close an assistant message (ChatML: `<|im_end|>\\n`) and the user message plus the
  next assistant header. A workflow appends only the part of the end-of-turn fragment an output did not already
  produce (an output that stopped on EOS ends with `<|im_end|>` and needs only `\\n`), so the decoded trajectory
  equals the chat template of the whole conversation.
- `count_tokens`: how many tokens a text has, without building the Python list of their ids. A server refusing a
  10 MB prompt as too long needs only the count; the list (millions of ints, plus transformers' attention mask)
  is built holding the GIL, while the server's event loop waits. A fast tokenizer counts in Rust, with
  the GIL released (`encode_batch`; `encode` keeps it).
- `token_lower_bound`: a count a text's tokens cannot be below, from its length alone: no token covers more
  characters than the longest vocabulary entry, with a factor 4 of margin for normalizers that merge characters
  (NFC). A 10 MB prompt is refused on that bound in microseconds instead of after seconds of tokenizing; servers
  find the longest entry (`longest_token`) while they load.
- `token_bytes`: each token's own bytes (byte-level BPE), so a character split over tokens is joined back exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from typing import Any, List, Optional, Sequence, Union

import torch

__all__ = [
    "load_hf_tokenizer",
    "apply_chat_template",
    "chat_prompt_ids",
    "count_tokens",
    "token_lower_bound",
    "longest_token",
    "ChatTurnFragments",
    "chat_turn_fragments",
]


# Content that no chat template changes, used to find where an assistant message's text ends inside the template.
_SENTINEL = "AREALLITESENTINEL7F3A"


def _as_id_list(out: Any) -> List[int]:
    """`apply_chat_template(tokenize=True)` output (list, nested list, tensor or BatchEncoding) -> list[int]."""
    if isinstance(out, Mapping):  # BatchEncoding is a Mapping
        out = out["input_ids"]
    if isinstance(out, torch.Tensor):
        out = out.tolist()
    out = list(out)
    if out and isinstance(out[0], (list, tuple, torch.Tensor)):
        if len(out) != 1:
            raise ValueError(f"expected the token ids of one conversation, got a batch of {len(out)}")
        out = list(out[0])
    return [int(t) for t in out]


def count_tokens(tokenizer, text: str, add_special_tokens: bool = True) -> int:
    """`len(tokenizer(text, add_special_tokens=...)["input_ids"])`, without the list (see the module docstring)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)  # fast tokenizers only
    if backend is None:
        return len(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
    return len(backend.encode_batch([text], add_special_tokens=add_special_tokens)[0])


def longest_token(tokenizer) -> int:
    """Characters in the tokenizer's longest vocabulary entry, computed once per tokenizer. That first call walks the
    whole vocabulary (tens of ms for 49k entries, holding the GIL), so servers make it while they load: a request
    that needs the bound then never pays for it beside the event loop."""
    longest = getattr(tokenizer, "_areal_lite_longest_token", None)
    if longest is None:
        longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
        tokenizer._areal_lite_longest_token = longest
    return longest


def token_lower_bound(tokenizer, text: str) -> int:
    """At most this many characters fit in one token; the text has at least len(text) // that many tokens."""
    return len(text) // (4 * max(longest_token(tokenizer), 1))


@lru_cache(maxsize=8)
def load_hf_tokenizer(model_name_or_path: str, fast_tokenizer: bool = True, padding_side: Optional[str] = None):
    """`AutoTokenizer.from_pretrained(...)` with `trust_remote_code`, pad = EOS when missing; one object per
    arguments (cached, as AReaL's). AReaL also forces a fresh download of hub files: the kit uses the local cache."""
    from transformers import AutoTokenizer

    kwargs = {} if padding_side is None else {"padding_side": padding_side}
    tokenizer = AutoTokenizer.from_pretrained(
        model_name_or_path, use_fast=fast_tokenizer, trust_remote_code=True, **kwargs
    )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token_id = tokenizer.eos_token_id
    return tokenizer


def apply_chat_template(tokenizer, messages: List[dict], *, tokenize: bool = True, **kwargs: Any):
    """`tokenizer.apply_chat_template`, a `list[int]` when tokenized (transformers 5 returns a BatchEncoding), else
    the text; `return_tensors`/`return_dict` keep transformers' own return."""
    out = tokenizer.apply_chat_template(messages, tokenize=tokenize, **kwargs)
    if not tokenize or kwargs.get("return_tensors") or kwargs.get("return_dict"):
        return out
    return _as_id_list(out)


def chat_prompt_ids(tokenizer, messages: Sequence[Mapping[str, Any]], **template_kwargs) -> List[int]:
    """Token ids of `messages` through the chat template, ending with the assistant header."""
    return apply_chat_template(tokenizer, list(messages), add_generation_prompt=True, **template_kwargs)


def _render(tokenizer, messages, add_generation_prompt: bool, **template_kwargs) -> str:
    out = apply_chat_template(
        tokenizer, messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
    )
    if not isinstance(out, str):
        raise TypeError(f"apply_chat_template(tokenize=False) returned {type(out).__name__}, expected str")
    return out


class ChatTurnFragments:
    """Pre-tokenized chat-template glue appended after an assistant output.

    `end_of_turn`: the tokens that close an assistant message (ChatML: `<|im_end|>` `\\n`).
    `user_turn`: a user message followed by the next assistant header.
    """

    def __init__(self, end_of_turn: List[int], user_turn: List[int], end_of_turn_text: str, user_turn_text: str):
        self.end_of_turn = list(end_of_turn)
        self.user_turn = list(user_turn)
        self.end_of_turn_text = end_of_turn_text
        self.user_turn_text = user_turn_text

    def closing_tokens(self, output_tokens: Sequence[int]) -> List[int]:
        """The part of `end_of_turn` that `output_tokens` did not already end with.

        An output that stopped on EOS ends with `<|im_end|>`, so only `\\n` is missing; one cut by length needs all.
        """
        eot, out = self.end_of_turn, list(output_tokens)
        for k in range(min(len(eot), len(out)), 0, -1):
            if out[-k:] == eot[:k]:
                return eot[k:]
        return list(eot)

    def after_output(self, output_tokens: Sequence[int]) -> List[int]:
        """Everything to append after an assistant output to start the next assistant turn."""
        return self.closing_tokens(output_tokens) + self.user_turn

    def __repr__(self) -> str:
        return f"ChatTurnFragments(end_of_turn={self.end_of_turn_text!r}, user_turn={self.user_turn_text!r})"


def chat_turn_fragments(
    tokenizer, user_content: Union[str, Sequence[Mapping[str, Any]]], **template_kwargs
) -> ChatTurnFragments:
    """Pre-tokenize, from the tokenizer's chat template, what follows an assistant message when a user replies.

    Rendered as text: T1 = template([user, assistant S]); T2 = template([user, assistant S, user R], generation
    prompt). The end-of-turn text is what T1 has after S; the user turn is T2 minus its prefix T1. `user_content`
    may also be the messages that follow instead of one user message (e.g. `role="tool"` results, which a template
    that renders tools wraps in its own way).
    """
    base = [{"role": "user", "content": "Question?"}, {"role": "assistant", "content": _SENTINEL}]
    t1 = _render(tokenizer, base, False, **template_kwargs)
    at = t1.rfind(_SENTINEL)
    if at < 0:
        raise ValueError("the chat template dropped the assistant message's content; cannot find the turn boundary")
    eot_text = t1[at + len(_SENTINEL) :]
    following = [{"role": "user", "content": user_content}] if isinstance(user_content, str) else list(user_content)
    t2 = _render(tokenizer, base + following, True, **template_kwargs)
    if not t2.startswith(t1):
        raise ValueError(
            "the chat template re-renders earlier turns when a user message is added, so a fixed fragment cannot be "
            "pre-tokenized for it"
        )
    user_text = t2[len(t1) :]
    enc = lambda s: _as_id_list(tokenizer(s, add_special_tokens=False)) if s else []  # noqa: E731
    return ChatTurnFragments(enc(eot_text), enc(user_text), eot_text, user_text)


@lru_cache(maxsize=1)
def _byte_decoder() -> dict:
    """Byte-level BPE's alphabet (GPT-2's `bytes_to_unicode`) reversed: vocabulary character -> its byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def token_bytes(tokenizer: Any, ids: Sequence[int]) -> List[bytes]:
    """Each token's bytes: a byte-level BPE token's from its vocabulary string, so that the bytes of the tokens of one
    character join back to it (OpenAI's logprob `bytes`); any other token's as its decoded text's UTF-8."""
    decoder = _byte_decoder()
    out = []
    for i, piece in zip(ids, tokenizer.convert_ids_to_tokens(list(ids))):
        if isinstance(piece, str) and piece and all(ch in decoder for ch in piece):
            out.append(bytes(decoder[ch] for ch in piece))
        else:
            out.append(tokenizer.decode([i]).encode("utf-8"))
    return out
