"""A session's completions: `InteractionCache` (AReaL 1.0.4's `areal.experimental.openai.cache`), rewards, export.

An `InteractionCache` is an ordered dict of `InteractionWithTokenLogpReward` (`types`) keyed by interaction id, in
insertion order -- the order `apply_reward_discount` walks back. `set_reward`, `set_last_reward`,
`apply_reward_discount` and `export_interactions` are AReaL's; `interactions_to_batch` stacks the exported rows.

Two ways in, one tree:
- `cache[id] = interaction` is AReaL's: the parent is the interaction with the most messages whose messages plus
  answer start the new one's messages, exactly (an agent appends `choice.message.model_dump()`).
- `cache.add(interaction)` keeps the parent the caller decided. The kit's chat server (`proxy.server`) looks it
  up before generating (`find_parent`, which also accepts an answer re-serialised by the SDK: whitespace, tool call
  ids, JSON formatting) and builds the prompt from the parent's ids; `Interaction` is its constructor.
Export: "concat" returns the leaves (each row carries its whole path) and needs every interaction to be
`chat_template_type="concat"`; "individual" returns all, each row with its own output only (AReaL's also trains on
the ancestors' outputs again; the kit does not count a token twice). `per_turn_returns=True` adds `token_returns`,
each token's own interaction's discounted reward. `n > 1`: every choice is its own interaction,
`<completion id>-<index>`; `set_reward(<completion id>, r)` sets all. Rewards must be finite.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections import OrderedDict
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch

from areal_lite.api.io_struct import ModelResponse
from areal_lite.experimental.openai.types import EXPORT_STYLES, InteractionWithTokenLogpReward
from areal_lite.utils.data import concat_padded_tensors

__all__ = [
    "Interaction",
    "InteractionCache",
    "InteractionWithTokenLogpReward",
    "interactions_to_batch",
    "normalize_message",
]

logger = logging.getLogger(__name__)


def _same_json_text(a: Any, b: Any) -> bool:
    if a == b:
        return True
    try:
        return json.loads(a) == json.loads(b)
    except (TypeError, ValueError, RecursionError):  # RecursionError: arguments nested past Python's stack
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


class Interaction(InteractionWithTokenLogpReward):
    """The kit's constructor for an `InteractionWithTokenLogpReward` of the chat server: id first, and
    `chat_template_type="concat"`, since the server builds every turn from its parent's ids (`chat_template`)."""

    def __init__(
        self,
        interaction_id: str,
        messages: List[Dict[str, Any]],
        output_message_list: List[Dict[str, Any]],
        model_response: ModelResponse,
        reward: Optional[float] = None,
        parent: Optional[InteractionWithTokenLogpReward] = None,
        completion_id: str = "",
        tools: Optional[List[dict]] = None,
        drift: bool = False,
        chat_template_type: str = "concat",
    ):
        super().__init__(
            model_response=model_response,
            reward=reward,
            parent=parent,
            chat_template_type=chat_template_type,
            messages=messages,
            output_message_list=output_message_list,
            _interaction_id=interaction_id,
            completion_id=completion_id,
            tools=tools,
            drift=drift,
        )


def _is_prefix(a: Sequence[Any], b: Sequence[Any]) -> bool:
    return len(a) <= len(b) and list(b[: len(a)]) == list(a)


def _differing_keys(a: Mapping[str, Any], b: Mapping[str, Any]) -> Optional[tuple]:
    """Where two messages differ only in keys one of them lacks: (a's extra keys, b's extra keys); else None."""
    shared = a.keys() & b.keys()
    if any(a[k] != b[k] for k in shared):
        return None
    return {k: v for k, v in a.items() if k not in shared}, {k: v for k, v in b.items() if k not in shared}


class InteractionCache(OrderedDict):
    """A session's interactions by id, in insertion order (AReaL 1.0.4's API; see the module docstring)."""

    def __init__(self, *args, **kwargs):
        # Set before filling: OrderedDict(items) inserts through __setitem__.
        self._apply_reward_discount_called = False
        self._total_reward = 0.0
        self._lock = threading.RLock()
        super().__init__(*args, **kwargs)

    def __deepcopy__(self, memo):
        """An empty cache can be deep-copied (a controller holding one is cloned); a filled one is a bug."""
        if len(self):
            raise RuntimeError(f"InteractionCache must be empty when deep-copied, but has {len(self)} items")
        new = type(self)()
        memo[id(self)] = new
        return new

    @property
    def last_interaction_id(self) -> str:
        if not self:
            raise KeyError("the cache is empty: no completion was made in this session")
        return next(reversed(self))

    @property
    def total_reward(self) -> float:
        """The sum of the rewards given through `set_reward` (before any discount)."""
        return self._total_reward

    # -------------------------------------------------------------------------------------------- inserting

    def __setitem__(self, key: str, value: InteractionWithTokenLogpReward) -> None:
        """Insert, linking the parent by AReaL's longest exact message-prefix rule."""
        if value.messages is None:
            raise ValueError("Interaction messages must be set to find parent relationship.")
        with self._lock:
            for parent in sorted(self.values(), key=lambda x: len(x.messages), reverse=True):
                if parent.output_message_list is None or parent.messages is None:
                    continue  # still being generated: cannot be a parent yet
                path = parent.messages + parent.output_message_list
                if _is_prefix(path, value.messages):
                    value.parent = parent
                    break
                if _is_prefix(parent.messages, value.messages) and len(path) <= len(value.messages):
                    diff = _differing_keys(path[-1], value.messages[len(path) - 1])
                    if diff is not None:
                        logger.warning(
                            "A parent's answer matches this conversation except for some keys, so they are not "
                            "linked. To build a conversation tree, append `choice.message.model_dump()` (responses: "
                            "`[o.model_dump() for o in response.output]`) to the messages. Keys only in the parent's "
                            "answer: %s; only in the child's message: %s",
                            *diff,
                        )
            super().__setitem__(key, value)

    def add(self, interaction: InteractionWithTokenLogpReward) -> None:
        """Insert with the parent the caller decided (the chat server's, found by `find_parent`)."""
        key = interaction.interaction_id
        with self._lock:
            if key in self:
                raise ValueError(f"interaction {key} is already in the cache")
            super().__setitem__(key, interaction)

    def find_parent(
        self, messages: Sequence[Mapping[str, Any]], tools: Optional[List[dict]] = None
    ) -> Optional[InteractionWithTokenLogpReward]:
        """The interaction this request continues: the one with the most messages whose messages and answer (as
        an SDK may re-serialise it) start `messages`, with something after, and the same tools; or None."""
        msgs = [normalize_message(m) for m in messages]
        with self._lock:
            candidates = sorted(self.values(), key=lambda i: len(i.messages), reverse=True)
        for it in candidates:
            k = len(it.messages)
            if not it.output_message_list or len(msgs) <= k + 1 or (it.tools or None) != (tools or None):
                continue
            if msgs[:k] == [normalize_message(m) for m in it.messages] and _same_assistant(it.output_message, msgs[k]):
                return it
        return None

    # -------------------------------------------------------------------------------------------- rewards

    def _ids_for(self, interaction_id: str) -> List[str]:
        if interaction_id in self:
            return [interaction_id]
        ids = [k for k, v in self.items() if v.completion_id and v.completion_id == interaction_id]
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
                self._total_reward += reward - (self[key].reward or 0.0)
                self[key].reward = reward

    def set_last_reward(self, reward: float) -> None:
        """Set the reward of the most recent completion."""
        self.set_reward(self.last_interaction_id, reward)

    def apply_reward_discount(self, turn_discount: float = 1.0) -> Dict[str, InteractionWithTokenLogpReward]:
        """Walk back in insertion order: `reward[i] += reward[i+1] * turn_discount` (once only). A missing reward
        counts 0.0; a missing last one is also a warning. Returns a shallow copy of the cache."""
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

    # -------------------------------------------------------------------------------------------- export

    def export_interactions(
        self, style: str, reward_discount: Optional[float] = None
    ) -> Dict[str, InteractionWithTokenLogpReward]:
        """`concat`: the leaves of the conversation tree; `individual`: all. Interactions still being generated
        are skipped; `reward_discount` applies `apply_reward_discount` first (unless it was already)."""
        if style not in EXPORT_STYLES:
            raise ValueError(f"Invalid export interactions style {style!r}; use one of {EXPORT_STYLES}")
        if reward_discount is not None and not self._apply_reward_discount_called:
            self.apply_reward_discount(turn_discount=reward_discount)
        with self._lock:
            items = list(self.items())
        done: Dict[str, InteractionWithTokenLogpReward] = {}
        for key, it in items:
            if it.interaction_id is None or it.output_message_list is None:
                logger.warning("skipping interaction %s: its completion has not finished", key)
                continue
            if it.interaction_id != key:
                raise ValueError(f"Interaction ID mismatch: {it.interaction_id} != {key}")
            done[key] = it
        if style == "individual":
            return done
        if any(it.chat_template_type != "concat" for it in done.values()):
            raise ValueError(
                "Cannot export interactions in 'concat' style when an interaction has chat_template_type != "
                "'concat': a chat template may add or drop tokens (e.g. think tokens) when it re-renders earlier "
                "turns, so a child's prompt need not extend its parent's ids. Use the 'individual' style."
            )
        parents = {it.parent.interaction_id for it in done.values() if it.parent is not None}
        return {key: it for key, it in done.items() if key not in parents}


def interactions_to_batch(
    interactions: Mapping[str, Interaction], style: str = "concat", per_turn_returns: bool = False
) -> Dict[str, torch.Tensor]:
    """The exported interactions as one batch of `[B, L]` rows (the kit's tensor contract); `{}` when empty."""
    rows = [i.to_tensor_dict(style, per_turn_returns=per_turn_returns) for i in interactions.values()]
    return concat_padded_tensors(rows)
