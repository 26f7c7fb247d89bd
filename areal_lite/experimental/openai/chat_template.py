"""OpenAI conversations to prompt token ids, token-exact across turns: `ChatTemplate`.

An agent sends its whole conversation on every turn, the assistant's earlier answers included as text. Rendering
that text again gives the model a prompt, but not necessarily the tokens it generated: a decode/encode round trip
can pick other ids, templates trim or rewrite assistant text, and a tool call comes back as re-serialised JSON.
Training on such a prompt would score tokens the model never sampled.

Design decisions
- A turn that continues an earlier completion of the session (`InteractionCache.find_parent`) is built from ids,
  never from text: the earlier prompt and generated ids exactly as sampled, the end-of-turn tokens the output did not
  produce, then the ids the template renders for the new messages (`continue_from`).
- Drift is detected, not assumed: a re-rendered conversation that starts with exactly those ids is used as is;
  otherwise `Continuation.drift` is True and the sampled ids are kept. When the two cannot be aligned,
  `continue_from` returns None and the caller renders afresh and counts a template mismatch.
- Tools: a template that renders `tools` (Qwen2.5, Llama 3.1, Hermes) gets them natively; one that ignores them
  (SmolLM2's ChatML, detected with a probe) gets the conversation rewritten to Hermes blocks or, with
  `tool_syntax="compact"`, to `<name>argument</name>` (`tool_call_parser`). A template with tool support keeps its
  own format whatever `tool_syntax` says: that is the format its model was tuned on.
- Stop tokens are the tokenizer's EOS and pad and the template's end-of-turn token, so a completion ends where an
  assistant message ends, whatever the model's generation config says.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence

from areal_lite.experimental.openai.tool_call_parser import (
    TOOL_SYNTAXES,
    ToolCallParse,
    compact_messages,
    hermes_messages,
    native_tool_messages,
    parse_compact_tool_calls,
    parse_tool_calls,
)
from areal_lite.utils.hf_utils import chat_prompt_ids

__all__ = ["ChatTemplate", "Continuation"]

_SENTINEL = "AREALLITECHATSENTINEL9B2E"
_PROBE_TOOL = {"type": "function", "function": {"name": "areal_lite_probe_tool", "description": "probe"}}


@dataclass
class Continuation:
    """The prompt ids of a turn that continues an earlier completion, and whether the template drifted."""

    input_ids: List[int]
    drift: bool


def _kth(ids: Sequence[int], target: int, k: int) -> int:
    """Index of the k-th (1-based) occurrence of `target` in `ids`, or -1."""
    seen = 0
    for i, t in enumerate(ids):
        if t == target:
            seen += 1
            if seen == k:
                return i
    return -1


class ChatTemplate:
    """A tokenizer's chat template as a token-exact, tool-aware prompt builder (see the module docstring)."""

    def __init__(
        self, tokenizer, chat_template_kwargs: Optional[Mapping[str, Any]] = None, tool_syntax: str = "hermes"
    ):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; a chat endpoint needs one (an instruct model)")
        if tool_syntax not in TOOL_SYNTAXES:
            raise ValueError(f"tool_syntax must be one of {TOOL_SYNTAXES}, got {tool_syntax!r}")
        self.tokenizer = tokenizer
        self.template_kwargs: Dict[str, Any] = dict(chat_template_kwargs or {})
        self.native_tools = self._renders_tools()
        # What the model reads and writes: its template's own format, else the one asked for.
        self.tool_syntax = "native" if self.native_tools else tool_syntax
        self.end_of_turn = self._end_of_turn_ids()
        self.anchor: Optional[int] = self.end_of_turn[0] if self.end_of_turn else None
        stops = {tokenizer.eos_token_id, tokenizer.pad_token_id, self.anchor} - {None}
        self.stop_token_ids: List[int] = sorted(int(t) for t in stops)

    # ------------------------------------------------------------------------------------------------ probes

    def _text(self, messages, add_generation_prompt: bool, **kw) -> str:
        out = self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **self.template_kwargs, **kw
        )
        return out if isinstance(out, str) else str(out)

    def _renders_tools(self) -> bool:
        msgs = [{"role": "user", "content": "Hi"}]
        try:
            return self._text(msgs, True, tools=[_PROBE_TOOL]) != self._text(msgs, True)
        except Exception:  # a template that chokes on `tools` certainly does not support them
            return False

    def _end_of_turn_ids(self) -> List[int]:
        """The ids a template writes after an assistant message's content (ChatML: `<|im_end|>` `\\n`)."""
        msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _SENTINEL}]
        text = self._text(msgs, False)
        at = text.rfind(_SENTINEL)
        if at < 0:
            return []
        tail = text[at + len(_SENTINEL) :]
        return list(self.tokenizer(tail, add_special_tokens=False)["input_ids"]) if tail else []

    # ------------------------------------------------------------------------------------------------ rendering

    def messages_for_template(self, messages: Sequence[Mapping[str, Any]], tools: Optional[Sequence[Mapping]]):
        """The conversation as this template should see it (rewritten when it has no tool support)."""
        if self.native_tools:
            return native_tool_messages(messages)
        if self.tool_syntax == "compact":
            return compact_messages(messages, tools)
        return hermes_messages(messages, tools)

    def parse_tool_calls(self, text: str, tools: Sequence[Mapping[str, Any]]) -> ToolCallParse:
        """A completion's text -> content and OpenAI tool calls, in the syntax this template asks for."""
        if self.tool_syntax == "compact":
            return parse_compact_tool_calls(text, tools)
        return parse_tool_calls(text, [(t.get("function") or {}).get("name") for t in tools])

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Optional[Sequence[Mapping]] = None,
        chat_template_kwargs: Optional[Mapping[str, Any]] = None,
    ) -> List[int]:
        """Prompt ids of the whole conversation, ending with the assistant header (`add_generation_prompt=True`)."""
        kw = self._render_kwargs(tools, chat_template_kwargs)
        return chat_prompt_ids(self.tokenizer, self.messages_for_template(messages, tools), **kw)

    def render_text(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Optional[Sequence[Mapping]] = None,
        chat_template_kwargs: Optional[Mapping[str, Any]] = None,
    ) -> str:
        """The text `render` tokenizes (its ids are those of this text, without added special tokens)."""
        kw = self._render_kwargs(tools, chat_template_kwargs)
        msgs = list(self.messages_for_template(messages, tools))
        out = self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kw)
        return out if isinstance(out, str) else str(out)

    def _render_kwargs(self, tools, chat_template_kwargs) -> Dict[str, Any]:
        kw = {**self.template_kwargs, **dict(chat_template_kwargs or {})}  # the request's win
        if self.native_tools and tools:
            kw["tools"] = list(tools)
        return kw

    def closing_tokens(self, output_ids: Sequence[int]) -> List[int]:
        """The part of the end-of-turn ids that `output_ids` did not already end with (all of it after a length
        cut; ChatML's `\\n` after an output that stopped on `<|im_end|>`)."""
        eot, out = self.end_of_turn, list(output_ids)
        for k in range(min(len(eot), len(out)), 0, -1):
            if out[-k:] == eot[:k]:
                return eot[k:]
        return list(eot)

    def continue_from(
        self, parent_input_ids: Sequence[int], parent_output_ids: Sequence[int], full_ids: Sequence[int]
    ) -> Optional[Continuation]:
        """The prompt of a turn after the completion (`parent_input_ids` -> `parent_output_ids`), given the ids of
        the whole new conversation rendered afresh (`render(...)`); None when the two cannot be aligned.

        The new part is located in the re-rendered conversation by counting end-of-turn tokens (the "anchor",
        ChatML's `<|im_end|>`), the rule AReaL 1.0.4's concat mode uses with the EOS token. The anchor is taken from
        the template itself, so a model whose EOS differs from its end-of-turn token still aligns. A template that
        drops or merges messages leaves no safe continuation: None."""
        base = list(parent_input_ids) + list(parent_output_ids) + self.closing_tokens(parent_output_ids)
        full = list(full_ids)
        if len(full) > len(base) and full[: len(base)] == base:
            return Continuation(full, drift=False)
        if self.anchor is None:
            return None
        idx = _kth(full, self.anchor, base.count(self.anchor))
        end = idx + len(self.end_of_turn)
        if idx < 0 or full[idx:end] != self.end_of_turn or end >= len(full):
            return None
        return Continuation(base + full[end:], drift=True)

    def __repr__(self) -> str:
        return (
            f"ChatTemplate(tool_syntax={self.tool_syntax!r}, end_of_turn={self.end_of_turn}, "
            f"stop_token_ids={self.stop_token_ids})"
        )
