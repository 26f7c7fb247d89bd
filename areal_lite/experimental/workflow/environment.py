"""Environments in TRL's and OpenEnv's shape, trained as a `RolloutWorkflow`: `EnvironmentWorkflow`.

An environment is a plain class: `reset(**row)` starts an episode from a data row and returns the first
observation (text appended to the row's last user message, or None); every public method is a tool, described to
the model by its type hints and Google-style docstring (transformers' `get_json_schema`, as TRL renders it);
`get_reward()` (TRL) or a `reward` attribute (OpenEnv) scores the episode. The same class runs unchanged under
TRL 1.16's `GRPOTrainer(environment_factory=...)` (`tools/trl_environment.py`).

Design decisions
- One instance per episode (`environment_factory()` each time): episodes run concurrently and share no state.
- Tool calls are parsed and results fed back through `ChatTemplate` in the syntax of notebook 09's endpoint
  (`tool_syntax="compact"` for a template without tools), appended as tokens, never re-tokenized with the output.
- A tool that raises answers `error: <Type>: <message>` and the episode goes on, so the model can learn from it;
  so does an async one past `tool_timeout`. Sync tools run inline, on the event loop: threads would finish in an
  order of their own and break same-seed-same-rewards (`call_tool`). A result JSON cannot hold is sent as `str()`.
  A reward that raises or is not finite scores 0.0, a `done` that raises ends the episode, a `reset` that raises
  rejects it (None); each, and a timeout, is logged as a warning. A class that is no environment is a `TypeError`.
- The episode ends at an answer without a tool call, when the environment sets `done = True` (OpenEnv's flag; TRL
  ignores it), or after `max_turns` completions.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

from areal_lite.api.cli_args import GenerationHyperparameters
from areal_lite.api.engine_api import InferenceEngine
from areal_lite.api.io_struct import ModelRequest
from areal_lite.api.workflow_api import RolloutWorkflow
from areal_lite.experimental.openai.chat_template import ChatTemplate
from areal_lite.utils.functional import discounted_returns
from areal_lite.utils.hf_utils import chat_turn_fragments
from areal_lite.utils.trajectory import TrajectoryBuilder

__all__ = ["EnvironmentSpec", "EnvironmentWorkflow", "inspect_environment", "call_tool"]

logger = logging.getLogger(__name__)

# TRL's rule: these are the environment's own methods, never tools.
RESERVED = ("reset", "get_reward")


@dataclass
class EnvironmentSpec:
    """What an environment class offers: its tools (OpenAI function schemas) and where its reward comes from."""

    name: str
    tools: List[Dict[str, Any]]
    reward_source: str  # "get_reward" (TRL's method) or "reward" (an attribute, OpenEnv-style)
    parameter_types: Dict[str, Dict[str, str]] = field(default_factory=dict)  # tool -> parameter -> JSON type


def inspect_environment(env: Any) -> EnvironmentSpec:
    """The tools and reward source of an environment instance; `TypeError` naming the class when it has none."""
    from transformers.utils import get_json_schema

    cls = type(env)
    if not callable(getattr(cls, "reset", None)):
        raise TypeError(f"{cls.__name__} is no environment: it has no reset(**row) method")
    if callable(getattr(cls, "get_reward", None)):
        source = "get_reward"
    elif hasattr(env, "reward") or isinstance(getattr(cls, "reward", None), property):
        source = "reward"
    else:
        raise TypeError(
            f"{cls.__name__} has no reward: define get_reward(self) -> float (TRL) or a `reward` attribute (OpenEnv)"
        )
    tools, types = [], {}
    # Listed on the class, as TRL does: listing the instance would evaluate its properties.
    for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction):
        if name.startswith("_") or name in RESERVED:
            continue
        try:
            schema = get_json_schema(getattr(env, name))
        except Exception as e:  # transformers' DocstringParsingException / TypeHintParsingException
            raise TypeError(f"{cls.__name__}.{name} cannot be offered as a tool: {e}") from None
        # The schema names the function (`__name__`); the model calls the attribute: an alias or a decorator without
        # functools.wraps would offer a tool no call can reach
        schema["function"]["name"] = name
        tools.append(schema)
        props = schema["function"].get("parameters", {}).get("properties", {})
        types[name] = {p: spec.get("type", "string") for p, spec in props.items()}
    if not tools:
        raise TypeError(f"{cls.__name__} has no tools: give it at least one public method besides reset/get_reward")
    return EnvironmentSpec(cls.__name__, tools, source, types)


def _coerce(value: Any, json_type: str) -> Any:
    """A compact call's text argument as the type the tool's signature asks for ("42" -> 42 for `int`)."""
    if not isinstance(value, str) or json_type == "string":
        return value
    text = value.strip()
    if json_type == "integer":
        return int(text)
    if json_type == "number":
        return float(text)
    if json_type == "boolean" and text.lower() in ("true", "false"):
        return text.lower() == "true"
    return value


class _TimedOut(Exception):
    """A tool call ran past its timeout (distinct from a `TimeoutError` the tool raises itself)."""


async def _bounded(awaitable: Any, timeout: Optional[float]) -> Any:
    """`awaitable`'s result within `timeout` seconds (None: no limit); `_TimedOut` after, with it cancelled."""
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    finally:
        if not task.done():  # timed out, or the episode itself was cancelled
            task.cancel()
    if not done:
        raise _TimedOut
    return task.result()


def _as_text(result: Any) -> str:
    """A tool's result as the model reads it: JSON, or `str()` of what JSON cannot hold (tuple keys, a cycle)."""
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result, default=str)
    except (TypeError, ValueError, RecursionError):
        return str(result)


async def call_tool(
    env: Any, spec: EnvironmentSpec, name: str, arguments: Mapping[str, Any], timeout: Optional[float] = None
) -> tuple[str, bool]:
    """Run one tool call on `env`; (its result as text, whether it failed). Never raises on a bad call.

    An async tool gets `timeout` seconds (None: no limit). A sync tool runs inline, on the event loop: a thread
    would finish at a time of its own, and the order in which a group's episodes then ask the server again decides
    which sampling stream each gets, so the same seed would no longer give the same rewards. Slow tools (I/O, a
    subprocess) should be `async`."""
    if name not in spec.parameter_types:
        return f"error: there is no tool {name!r}", True
    types = spec.parameter_types[name]
    try:
        args = {k: _coerce(v, types.get(k, "string")) for k, v in arguments.items()}
        result = getattr(env, name)(**args)
        if inspect.isawaitable(result):
            result = await _bounded(result, timeout)
        return _as_text(result), False
    except _TimedOut:  # the environment's fault, not the model's: a warning, and the model reads it as an error
        logger.warning("%s.%s timed out after %g s", spec.name, name, timeout)
        return f"error: tool {name} timed out after {timeout:g} s", True
    except Exception as e:  # the model's call went wrong: it reads why, and the episode goes on
        return f"error: {type(e).__name__}: {e}", True


class EnvironmentWorkflow(RolloutWorkflow):
    """Train a model in any TRL/OpenEnv-shaped environment: one instance per episode, tool calls parsed from the
    model's text, results appended as turns, the environment's reward on the row.

    Args:
        environment_factory: a zero-argument callable (usually the class) returning a fresh environment.
        gconfig: sampling settings of each completion (`n_samples` is ignored: the group is the engine's).
        tokenizer: the policy's tokenizer (its chat template renders the conversation).
        max_turns: completions per episode at most.
        turn_discount: gamma of the turn-level returns `G_k = r_k + gamma * G_{k+1}` (1.0: every completion of
            the episode is trained with its final reward).
        tool_syntax: "compact" (`<count>apples</count>`, for a small model whose template knows no tools) or
            "hermes"; a template that renders tools itself (Qwen2.5) keeps its own format.
        reward_per_turn: read the reward after `reset` and after every turn; turn k's reward is its change, so the
            returns credit the turn that earned it (with gamma = 1 they add up to the final reward).
        log: a list to which every episode appends a record (reward, turns, calls, texts) for plots and viewers;
            `reward_error` and `env_error` (a `done` that raised) say what failed, None when nothing did.
        tool_timeout: seconds one call of an async tool may take (None: no limit); a call past it answers
            `error: tool <name> timed out after <N> s`, counted in `tool_errors`. A sync tool runs inline and
            cannot be timed out: write a slow one as `async def`.
        chat_template_kwargs: extra variables for the chat template (e.g. `enable_thinking`).

    Data rows: `prompt` (chat messages, or a string) plus whatever `reset` takes; the row is passed whole.
    Output: one row with `rewards` [1] = G_0, `env_reward` [1] (the environment's final reward), `turns` [1],
    `tool_calls` [1], `tool_errors` [1]; `token_returns` [1, L] when turns get different returns.

    ```python
    workflow = EnvironmentWorkflow(Warehouse, config.gconfig, tokenizer, max_turns=3)
    batch = engine.rollout_batch([{"prompt": [{"role": "user", "content": ""}], "seed": 1}], workflow=workflow)
    ```
    """

    def __init__(
        self,
        environment_factory: Callable[[], Any],
        gconfig: GenerationHyperparameters,
        tokenizer,
        max_turns: int = 4,
        turn_discount: float = 1.0,
        tool_syntax: str = "compact",
        *,
        reward_per_turn: bool = False,
        chat_template_kwargs: Optional[Mapping[str, Any]] = None,
        log: Optional[List[Dict[str, Any]]] = None,
        tool_timeout: Optional[float] = 30.0,
    ):
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if not 0.0 < turn_discount <= 1.0:
            raise ValueError(f"turn_discount must be in (0, 1], got {turn_discount}")
        if tool_timeout is not None and not tool_timeout > 0:
            raise ValueError(f"tool_timeout must be > 0 seconds or None, got {tool_timeout}")
        self.environment_factory = environment_factory
        self.spec = inspect_environment(environment_factory())
        self.tokenizer = tokenizer
        self.gconfig = gconfig.new_with_stop_and_pad_token_ids(tokenizer).new(n_samples=1)
        self.template = ChatTemplate(tokenizer, chat_template_kwargs, tool_syntax=tool_syntax)
        self.max_turns = int(max_turns)
        self.turn_discount = float(turn_discount)
        self.reward_per_turn = bool(reward_per_turn)
        self.log = log
        self.tool_timeout = None if tool_timeout is None else float(tool_timeout)

    # ------------------------------------------------------------------------------------------------ text

    def messages(self, data: Mapping[str, Any], observation: Any) -> List[Dict[str, Any]]:
        """The row's prompt with `reset`'s observation appended to its last user message (TRL's rule)."""
        prompt = data.get("prompt", data.get("messages"))
        if prompt is None:
            prompt = [{"role": "user", "content": ""}]
        elif isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        messages = [dict(m) for m in prompt]
        if observation is not None:
            messages[-1]["content"] = (messages[-1].get("content") or "") + str(observation)
        return messages

    def _results_turn(self, output_ids: Sequence[int], results: Sequence[str]) -> List[int]:
        """The tokens after an output whose calls returned `results`: the rest of its end of turn, then the
        results as the template renders them, then the next assistant header."""
        tool_messages = [{"role": "tool", "content": r} for r in results]
        if self.template.native_tools:
            following = tool_messages
            kw = {**self.template.template_kwargs, "tools": self.spec.tools}
        else:  # the rewrite `ChatTemplate` applies to a whole conversation, for these messages alone
            following = self.template.messages_for_template(tool_messages, None)
            kw = dict(self.template.template_kwargs)
        fragments = chat_turn_fragments(self.tokenizer, following, **kw)
        return fragments.closing_tokens(output_ids) + fragments.user_turn

    # ------------------------------------------------------------------------------------------------ episode

    async def _reward(self, env: Any) -> tuple[float, Optional[str]]:
        """The environment's reward now; (0.0, why) when reading it fails or it is not a finite number."""
        try:
            value = env.get_reward() if self.spec.reward_source == "get_reward" else env.reward
            if inspect.isawaitable(value):
                value = await value
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(f"reward is {value}")
        except Exception as e:
            logger.warning("%s's reward failed, scored 0.0: %s: %s", self.spec.name, type(e).__name__, e)
            return 0.0, f"{type(e).__name__}: {e}"
        return value, None

    def _done(self, env: Any, record: Dict[str, Any]) -> bool:
        """Whether the environment says the episode is over (OpenEnv's `done`); a `done` that raises ends it, logged
        and kept as the record's `env_error`."""
        try:
            return bool(getattr(env, "done", False))
        except Exception as e:
            logger.warning("%s.done failed; episode ended: %s: %s", self.spec.name, type(e).__name__, e)
            record["env_error"] = f"done: {type(e).__name__}: {e}"
            return True

    async def _act(
        self, env: Any, calls: Sequence[Dict[str, Any]], turn: int, record: Dict[str, Any]
    ) -> tuple[List[str], bool]:
        """Run one completion's tool calls in order; (their results, whether the episode is over)."""
        results: List[str] = []
        for call in calls:
            if self._done(env, record):
                return results, True
            fn = call["function"]
            result, failed = await call_tool(env, self.spec, fn["name"], json.loads(fn["arguments"]), self.tool_timeout)
            record["calls"].append({"turn": turn, "name": fn["name"], "arguments": fn["arguments"],
                                    "result": result, "error": failed})  # fmt: skip
            results.append(result)
        return results, not results or self._done(env, record)

    async def arun_episode(self, engine: InferenceEngine, data: Mapping[str, Any]):
        env = self.environment_factory()
        try:
            observation = env.reset(**data)
        except Exception as e:
            logger.warning("%s.reset failed; episode rejected: %s: %s", self.spec.name, type(e).__name__, e)
            return None
        prompt_ids = self.template.render(self.messages(data, observation), self.spec.tools)
        builder = TrajectoryBuilder().add_prompt(prompt_ids)
        rid = uuid.uuid4().hex
        record: Dict[str, Any] = {"observation": observation, "texts": [], "calls": [], "parse_errors": 0}
        record["env_error"] = None  # a `done` that raised (`_done`)
        levels = [await self._reward(env)] if self.reward_per_turn else []
        for turn in range(self.max_turns):
            req = ModelRequest(rid=rid, input_ids=builder.context(), gconfig=self.gconfig, tokenizer=self.tokenizer)
            resp = await engine.agenerate(req)
            builder.add_output(resp)
            text = self.tokenizer.decode(list(resp.output_tokens), skip_special_tokens=True)
            record["texts"].append(text)
            parsed = self.template.parse_tool_calls(text, self.spec.tools)
            record["parse_errors"] += parsed.error is not None
            results, ended = await self._act(env, parsed.tool_calls, turn, record)
            if self.reward_per_turn:
                levels.append(await self._reward(env))
            if ended or turn + 1 == self.max_turns:
                break
            builder.add_observation(self._results_turn(resp.output_tokens, results), kind="tool")
        turns = builder.num_turns
        if self.reward_per_turn:
            final, error = levels[-1]
            turn_rewards = [b[0] - a[0] for a, b in zip(levels, levels[1:])]
        else:
            final, error = await self._reward(env)
            turn_rewards = [0.0] * (turns - 1) + [final]
        returns = discounted_returns(turn_rewards, self.turn_discount)
        extra = {}
        if self.reward_per_turn or self.turn_discount < 1.0:  # the actor reads token_returns (notebook 06)
            extra["token_returns"] = builder.per_turn_values(returns)
        errors = sum(c["error"] for c in record["calls"])
        if self.log is not None:
            self.log.append({**record, "reward": final, "reward_error": error, "turns": turns, "data": dict(data)})
        return builder.to_tensors(
            returns[0], env_reward=final, turns=turns, tool_calls=len(record["calls"]), tool_errors=errors, **extra
        )
