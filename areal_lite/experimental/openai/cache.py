"""What an agent's chat completions leave behind: `Interaction`, `InteractionCache`, rewards and the training batch.

Every completion served by `proxy.server.ChatServer` is one `Interaction`: the messages it answered, the assistant
message it returned, and the `ModelResponse` behind it (prompt ids, generated ids, logprobs, weight versions). A
session's interactions live in one `InteractionCache`, an ordered dict keyed by completion id.

Design decisions
- AReaL 1.0.4's names and semantics (`areal.experimental.openai.cache`): `set_reward`, `set_last_reward`,
  `apply_reward_discount`, `export_interactions`, `to_tensor_dict`, and `InteractionWithTokenLogpReward`'s fields.
- The conversation tree is known before generating: a turn that continues an earlier completion is built from its
  ids (`chat_template`), so its parent is found when the request arrives (`find_parent`, AReaL's longest-prefix
  rule). An interaction is inserted when its completion finishes, so insertion order -- the order
  `apply_reward_discount` walks -- is the order the agent received answers.
- Rows follow the kit's tensor contract (`utils.trajectory`). Concat: one row per leaf, loss on the generated tokens
  of every interaction on its path, 0 on what the environment or the template added; the reward is the leaf's.
  Individual: one row per interaction, loss on its own output only (AReaL's also trains on the ancestors' outputs
  again; the kit does not count a token twice).
- `per_turn_returns=True` adds `token_returns`: each interaction's discounted reward on its own tokens, the
  multi-turn convention of `MultiTurnFeedbackWorkflow`. Off by default, which trains like AReaL.
- `n > 1`: every choice is its own interaction, `<completion id>-<index>`; `set_reward(<completion id>, r)` sets all.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch

from areal_lite.api.io_struct import ModelResponse
from areal_lite.utils.data import concat_padded_tensors

__all__ = ["Interaction", "InteractionCache", "interactions_to_batch", "normalize_message"]

logger = logging.getLogger(__name__)

EXPORT_STYLES = ("concat", "individual")


def _same_json_text(a: Any, b: Any) -> bool:
    if a == b:
        return True
    try:
        return json.loads(a) == json.loads(b)
    except (TypeError, ValueError):
        return False


def normalize_message(m: Mapping[str, Any]) -> Dict[str, Any]:
    """A message reduced to what renders: role, content (text or None), tool_calls, tool_call_id, name."""
    out: Dict[str, Any] = {"role": m.get("role"), "content": m.get("content")}
    for key in ("tool_calls", "tool_call_id", "name"):
        if m.get(key):
            out[key] = m[key]
    return out


def _same_assistant(recorded: Mapping[str, Any], sent: Mapping[str, Any]) -> bool:
    """Whether `sent` is the answer `recorded`, as an agent may hand it back: compared on what the agent cannot
    legitimately change (surrounding whitespace, tool call ids and argument formatting may differ), so
    `messages.append(choice.message.model_dump())` and `{"role": "assistant", "content": text}` both link."""
    if sent.get("role") != "assistant":
        return False
    if (recorded.get("content") or "").strip() != (sent.get("content") or "").strip():
        return False
    a, b = recorded.get("tool_calls") or [], sent.get("tool_calls") or []
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        fx, fy = x.get("function") or {}, y.get("function") or {}
        if fx.get("name") != fy.get("name") or not _same_json_text(fx.get("arguments"), fy.get("arguments")):
            return False
    return True


@dataclass
class _Row:
    ids: List[int]
    logprobs: List[float]
    loss_mask: List[int]
    versions: List[int]
    owners: List[Optional["Interaction"]]  # the interaction that generated each token (None: not generated)


@dataclass(eq=False)
class Interaction:
    """One chat completion choice with its tokens (AReaL's `InteractionWithTokenLogpReward` fields)."""

    interaction_id: str
    messages: List[Dict[str, Any]]
    output_message_list: List[Dict[str, Any]]
    model_response: ModelResponse
    reward: Optional[float] = None
    parent: Optional["Interaction"] = None
    completion_id: str = ""
    tools: Optional[List[dict]] = None
    drift: bool = False  # the template re-rendered the parent's answer differently; its generated ids were kept
    created: float = field(default_factory=time.time)

    @property
    def output_message(self) -> Dict[str, Any]:
        return self.output_message_list[0]

    def __repr__(self) -> str:  # short: the default would print the tokenizer and the whole parent chain
        resp, parent = self.model_response, self.parent.interaction_id if self.parent else None
        return (
            f"Interaction({self.interaction_id!r}, prompt={resp.input_len} tokens, output={resp.output_len} tokens, "
            f"stop={resp.stop_reason!r}, reward={self.reward}, parent={parent!r}, drift={self.drift})"
        )

    def _row(self, concat: bool) -> _Row:
        resp = self.model_response
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
            if row.ids[:k] != p.ids:  # cannot happen for prompts built by ChatTemplate; say so if it does
                raise ValueError(f"interaction {self.interaction_id}: its prompt does not extend its parent's ids")
            row.logprobs[:k], row.loss_mask[:k], row.versions[:k], row.owners[:k] = (
                p.logprobs,
                p.loss_mask,
                p.versions,
                p.owners,
            )
        return row

    def to_tensor_dict(self, style: str = "concat", per_turn_returns: bool = False) -> Dict[str, torch.Tensor]:
        """This interaction's `[1, L]` row (the kit's tensor contract, `utils.trajectory`). In concat style a
        child's prompt must extend its parent's ids exactly, which is checked."""
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


class InteractionCache(OrderedDict):
    """A session's interactions by id, in the order their completions finished (AReaL 1.0.4's API)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._apply_reward_discount_called = False
        self._lock = threading.RLock()

    @property
    def last_interaction_id(self) -> str:
        if not self:
            raise KeyError("the cache is empty: no completion was made in this session")
        return next(reversed(self))

    @property
    def total_reward(self) -> float:
        return sum(float(i.reward or 0.0) for i in self.values())

    def add(self, interaction: Interaction) -> None:
        with self._lock:
            if interaction.interaction_id in self:
                raise ValueError(f"interaction {interaction.interaction_id} is already in the cache")
            self[interaction.interaction_id] = interaction

    def find_parent(
        self, messages: Sequence[Mapping[str, Any]], tools: Optional[List[dict]] = None
    ) -> Optional[Interaction]:
        """The interaction this conversation continues: the longest one whose messages and answer start
        `messages` (same tools), or None (AReaL's longest-prefix rule)."""
        msgs = [normalize_message(m) for m in messages]
        with self._lock:
            candidates = sorted(self.values(), key=lambda i: len(i.messages), reverse=True)
        for it in candidates:
            k = len(it.messages)
            if len(msgs) <= k + 1 or (it.tools or None) != (tools or None):
                continue
            if msgs[:k] == [normalize_message(m) for m in it.messages] and _same_assistant(it.output_message, msgs[k]):
                return it
        return None

    def _ids_for(self, interaction_id: str) -> List[str]:
        if interaction_id in self:
            return [interaction_id]
        ids = [k for k, v in self.items() if v.completion_id == interaction_id]
        if not ids:
            raise KeyError(f"no interaction {interaction_id!r} in this session; known ids: {list(self)[:8]}")
        return ids

    def set_reward(self, interaction_id: str, reward: float) -> None:
        """Set the reward of a completion by its id (a completion id with n > 1 choices sets every choice)."""
        reward = float(reward)
        if not math.isfinite(reward):
            raise ValueError(f"reward must be finite, got {reward}")
        with self._lock:
            for key in self._ids_for(interaction_id):
                self[key].reward = reward

    def set_last_reward(self, reward: float) -> None:
        """Set the reward of the most recent completion."""
        self.set_reward(self.last_interaction_id, reward)

    def apply_reward_discount(self, turn_discount: float = 1.0) -> Dict[str, Interaction]:
        """Walk back in insertion order: `reward[i] += reward[i+1] * turn_discount` (AReaL's rule; once only). A
        missing reward counts 0.0; a missing last one is also a warning."""
        with self._lock:
            if self._apply_reward_discount_called:
                raise RuntimeError("apply_reward_discount should only be called once.")
            self._apply_reward_discount_called = True
            running = 0.0
            for i, it in enumerate(reversed(list(self.values()))):
                if it.reward is None:
                    if i == 0:
                        logger.warning("the most recent interaction has no reward: it and the earlier ones count 0.0")
                    it.reward = 0.0
                running = running * float(turn_discount) + float(it.reward)
                it.reward = running
            return dict(self)

    def export_interactions(self, style: str, reward_discount: Optional[float] = None) -> Dict[str, Interaction]:
        """`concat`: the leaves of the conversation tree (each row carries its whole path); `individual`: all."""
        if style not in EXPORT_STYLES:
            raise ValueError(f"Invalid export interactions style {style!r}; use one of {EXPORT_STYLES}")
        if reward_discount is not None and not self._apply_reward_discount_called:
            self.apply_reward_discount(turn_discount=reward_discount)
        with self._lock:
            items = dict(self)
        if style == "individual":
            return items
        parents = {id(i.parent) for i in items.values() if i.parent is not None}
        return {k: v for k, v in items.items() if id(v) not in parents}


def interactions_to_batch(
    interactions: Mapping[str, Interaction], style: str = "concat", per_turn_returns: bool = False
) -> Dict[str, torch.Tensor]:
    """The exported interactions as one batch of `[B, L]` rows (the kit's tensor contract); `{}` when empty."""
    rows = [i.to_tensor_dict(style, per_turn_returns=per_turn_returns) for i in interactions.values()]
    return concat_padded_tensors(rows)
