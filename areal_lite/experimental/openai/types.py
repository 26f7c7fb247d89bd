"""One chat completion with its tokens, logprobs and reward: `InteractionWithTokenLogpReward` (AReaL 1.0.4's
`areal.experimental.openai.types`, same fields in the same order, same properties).

An interaction records the messages a completion answered, the assistant message(s) it returned and the
`ModelResponse` behind it; `parent` links the completion an agent's conversation continued, which
`InteractionCache` finds by message prefix. `to_tensor_dict()` turns it into one training row (the kit's tensor
contract, `utils.trajectory`): with `chat_template_type="concat"` and a parent, the row is the whole path, loss on
every generated token of it; otherwise the prompt and this completion's output only.

Kit differences: equality is identity (a node of a conversation tree, not its content); a row is rebuilt on every
call (AReaL's keeps the first, so a reward set later was lost), unless one was restored into `_cache`; a concat
prompt that does not extend its parent's ids is refused (AReaL's masks or misaligns the parent silently);
`to_tensor_dict(style, per_turn_returns)` adds the kit's individual style and per-turn returns. Kit fields come
after AReaL's: `completion_id` (the completion of n > 1 choices), `tools`, `drift` (see `proxy.server`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import torch

from areal_lite.api.io_struct import ModelResponse

if TYPE_CHECKING:  # the openai SDK is needed only by agents that build these objects
    from openai.types.chat import ChatCompletion
    from openai.types.responses.response import Response

__all__ = ["ApiType", "InputName", "InteractionWithTokenLogpReward", "concat_string_interactions", "EXPORT_STYLES"]

logger = logging.getLogger(__name__)

EXPORT_STYLES = ("concat", "individual")


class ApiType(str, Enum):
    COMPLETION = "completion"
    RESPONSE = "response"
    NONE = "none"


class InputName(str, Enum):
    MESSAGES = "messages"
    INPUT_DATA = "input_data"
    NONE = "none"


@dataclass
class _Row:
    ids: List[int]
    logprobs: List[float]
    loss_mask: List[int]
    versions: List[int]
    owners: List[Optional["InteractionWithTokenLogpReward"]]  # who generated each token (None: not generated)


@dataclass(eq=False, repr=False)
class InteractionWithTokenLogpReward:
    """A completion (or response) with its tokens, logprobs and reward (see the module docstring)."""

    model_response: Optional[ModelResponse] = None
    reward: Optional[float] = None
    parent: Optional["InteractionWithTokenLogpReward"] = None
    chat_template_type: str = "hf"
    _cache: Optional[Dict[str, torch.Tensor]] = None
    messages: List[dict] = field(default_factory=list)
    output_message_list: Optional[List[dict]] = None
    completion: Optional["ChatCompletion"] = None
    response: Optional["Response"] = None
    input_data: Any = field(default_factory=lambda: "")
    _interaction_id: Optional[str] = None
    # kit fields
    completion_id: str = ""
    tools: Optional[List[dict]] = None
    drift: bool = False  # the template re-rendered the parent's answer differently; its generated ids were kept

    @property
    def has_tensor_data(self) -> bool:
        return self.model_response is not None or self._cache is not None

    @property
    def is_completion(self) -> bool:
        return self.completion is not None

    @property
    def is_response(self) -> bool:
        return self.response is not None

    @property
    def api_type(self) -> ApiType:
        return ApiType.COMPLETION if self.is_completion else ApiType.RESPONSE if self.is_response else ApiType.NONE

    @property
    def input_name_for_logging(self) -> InputName:
        if self.is_completion:
            return InputName.MESSAGES
        return InputName.INPUT_DATA if self.is_response else InputName.NONE

    @property
    def current_data(self) -> Any:
        if self.is_completion:
            return self.messages
        return self.input_data if self.is_response else None

    @property
    def parent_data(self) -> Any:
        return None if self.parent is None else self.parent.current_data

    @property
    def interaction_id(self) -> Optional[str]:
        """The completion's (or response's) id; otherwise the one set here."""
        if self.is_completion:
            return self.completion.id
        if self.is_response:
            return self.response.id
        return self._interaction_id

    @interaction_id.setter
    def interaction_id(self, value: Optional[str]) -> None:
        if self.is_completion or self.is_response:
            raise ValueError("Cannot set ID for completion or responses")
        self._interaction_id = value

    @property
    def created_at(self) -> Optional[float]:
        if self.is_completion:
            return float(self.completion.created)
        return float(self.response.created_at) if self.is_response else None

    @property
    def remaining_messages(self) -> List[dict]:
        """The messages added since the parent's answer (all of them without a parent)."""
        if self.parent is None:
            return self.messages
        if self.parent.output_message_list is None:
            raise ValueError("Parent output message is not set.")
        return self.messages[len(self.parent.messages) + len(self.parent.output_message_list) :]

    @property
    def output_message(self) -> Dict[str, Any]:
        """The (first) assistant message returned."""
        return self.output_message_list[0]

    def __repr__(self) -> str:  # short: the default would print the tokenizer and the whole parent chain
        resp, parent = self.model_response, self.parent.interaction_id if self.parent else None
        tokens = "no response" if resp is None else f"prompt={resp.input_len} tokens, output={resp.output_len} tokens"
        return (
            f"{type(self).__name__}({self.interaction_id!r}, {tokens}, reward={self.reward}, parent={parent!r}, "
            f"chat_template_type={self.chat_template_type!r}, drift={self.drift})"
        )

    def _row(self, concat: bool) -> _Row:
        resp = self.model_response
        if resp is None:
            raise ValueError("Model response is not set.")
        n_in, out = len(resp.input_tokens), list(resp.output_tokens)
        row = _Row(
            ids=list(resp.input_tokens) + out,
            logprobs=[0.0] * n_in + [float(x) for x in resp.output_logprobs],
            loss_mask=[0] * n_in + [1] * len(out),
            versions=[-1] * n_in + [int(v) for v in resp.output_versions],
            owners=[None] * n_in + [self] * len(out),
        )
        if concat and self.parent is not None:
            p = self.parent._row(True)
            k = len(p.ids)
            if n_in < k or row.ids[:k] != p.ids:  # prompts built by concat_prompt_token_ids_with_parent always do
                raise ValueError(f"interaction {self.interaction_id}: its prompt does not extend its parent's ids")
            row.logprobs[:k], row.loss_mask[:k], row.versions[:k], row.owners[:k] = (
                p.logprobs,
                p.loss_mask,
                p.versions,
                p.owners,
            )
        return row

    def to_tensor_dict(self, style: Optional[str] = None, per_turn_returns: bool = False) -> Dict[str, torch.Tensor]:
        """This interaction's `[1, L]` row. `style` None: "concat" when `chat_template_type == "concat"` (AReaL's
        rule), else "individual" (its own output only). `per_turn_returns` adds `token_returns`: each token's
        generating interaction's reward."""
        if self._cache is not None and style is None and not per_turn_returns:
            return self._cache
        if style is None:
            style = "concat" if self.chat_template_type == "concat" else "individual"
        if style not in EXPORT_STYLES:
            raise ValueError(f"style must be one of {EXPORT_STYLES}, got {style!r}")
        row = self._row(concat=style == "concat")
        reward = 0.0 if self.reward is None else float(self.reward)
        if not math.isfinite(reward):
            raise ValueError(f"interaction {self.interaction_id} has a non-finite reward {reward}")
        out = {
            "input_ids": torch.tensor([row.ids], dtype=torch.int32),
            "attention_mask": torch.ones(1, len(row.ids), dtype=torch.bool),
            "loss_mask": torch.tensor([row.loss_mask], dtype=torch.int32),
            "logprobs": torch.tensor([row.logprobs], dtype=torch.float32),
            "versions": torch.tensor([row.versions], dtype=torch.int32),
            "rewards": torch.tensor([reward], dtype=torch.float32),
        }
        if per_turn_returns:
            values = [0.0 if o is None else float(o.reward or 0.0) for o in row.owners]
            out["token_returns"] = torch.tensor([values], dtype=torch.float32)
        return out


def concat_string_interactions(interactions: Dict[str, InteractionWithTokenLogpReward]) -> Dict[str, List[dict]]:
    """Interactions without tokens (an external API) as `{"interactions": [{request, response, reward}, ...]}`."""
    rows = []
    for it in interactions.values():
        answer = it.output_message_list[0]["content"] if it.output_message_list else ""
        rows.append({"request": it.messages, "response": answer, "reward": it.reward})
    return {"interactions": rows}
