"""Train any OpenAI-client agent: `OpenAIAgentWorkflow` runs `await agent.run(data, base_url=, api_key=,
http_client=)` against the kit's chat endpoint and turns what it said into training rows.

    class Agent:
        async def run(self, data, **kw):
            client = openai.AsyncOpenAI(base_url=kw["base_url"], api_key=kw["api_key"], http_client=kw["http_client"])
            reply = await client.chat.completions.create(model="any", messages=[{"role": "user", "content": data["q"]}])
            return float(reply.choices[0].message.content.strip() == data["a"])   # or {completion_id: reward}

    wf = OpenAIAgentWorkflow(Agent(), tokenizer, gconfig, export_style="concat", turn_discount=1.0)
    rows = engine.rollout_batch(data, wf, group_size=4)                         # GRPO groups, as any workflow

Design decisions
- AReaL 1.0.4's contract (`OpenAIProxyWorkflow`, inline mode): `run` returns a float (the last completion's reward)
  or a dict {completion id: reward}; then `apply_reward_discount`, then `export_interactions`, AReaL's order.
- Unlike AReaL: the default export style is "concat" (one row per linear conversation, what GRPO groups need), not
  "individual"; AReaL's `discount` is `turn_discount`; `discount_fn` (kit-only) replaces the cache's walk.
- One chat server per engine (`server_for`), one session per episode: episodes and group members never mix.
- Failures never kill the rollout: `on_error` "zero" (default, `_fail`), "reject" or "raise" (debugging).
- Agents should build their `AsyncOpenAI` with `max_retries=0`: a retried request is generated and recorded twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import numbers
import threading
from collections import Counter
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import torch

from areal_lite.api.cli_args import GenerationHyperparameters
from areal_lite.api.engine_api import InferenceEngine
from areal_lite.api.workflow_api import RolloutWorkflow
from areal_lite.experimental.openai.cache import EXPORT_STYLES, interactions_to_batch
from areal_lite.experimental.openai.proxy.server import ChatServer, ChatSession

__all__ = ["OpenAIAgentWorkflow"]

logger = logging.getLogger(__name__)

ON_ERROR = ("zero", "reject", "raise")


class _AgentFailure(Exception):
    """The agent or its reward failed; the message is the reason that is logged."""


@contextlib.asynccontextmanager
async def _http_client():
    """The `http_client` an agent gets: no timeout (a request may wait through a pause for a weight update) and
    `trust_env=False` (a proxy from the environment must not intercept 127.0.0.1); None without httpx (the agent
    then uses its own client)."""
    try:
        import httpx
    except ImportError:
        yield None
        return
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), trust_env=False) as client:
        yield client


class OpenAIAgentWorkflow(RolloutWorkflow):
    """Roll out an OpenAI-client agent through the kit's chat endpoint (see the module docstring).

    Row counts: "concat" gives one row per leaf of the conversation tree -- one per episode for an agent that keeps
    one conversation -- so `group_size=G` gives the G contiguous rows group normalisation expects. "individual"
    gives one row per completion: use it with batch-level normalisation, not group normalisation. `server=` (a
    started `ChatServer`) is used as is; otherwise one is started per engine on first use, shared by the grouped
    copies the engine makes, and stopped by `close()`."""

    def __init__(
        self,
        agent: Any,
        tokenizer,
        gconfig: Optional[GenerationHyperparameters] = None,
        export_style: str = "concat",
        turn_discount: float = 1.0,
        *,
        server: Optional[ChatServer] = None,
        model: str = "areal-lite",
        timeout: Optional[float] = None,
        on_error: str = "zero",
        per_turn_returns: bool = False,
        chat_template_kwargs: Optional[Dict[str, Any]] = None,
        tool_syntax: str = "hermes",
        discount_fn: Optional[Callable[[Sequence[Optional[float]], float], List[float]]] = None,
        verbose: bool = False,
    ):
        run = getattr(agent, "run", None)
        if run is None or not asyncio.iscoroutinefunction(run):
            raise TypeError(f"the agent must have `async def run(self, data, **extra_kwargs)`; got {agent!r}")
        if export_style not in EXPORT_STYLES:
            raise ValueError(f"export_style must be one of {EXPORT_STYLES}, got {export_style!r}")
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
        self.agent, self.tokenizer = agent, tokenizer
        self.gconfig = gconfig if gconfig is not None else GenerationHyperparameters(max_new_tokens=512)
        self.export_style, self.turn_discount = export_style, float(turn_discount)
        self.model, self.timeout, self.on_error = model, timeout, on_error
        self.per_turn_returns, self.verbose = bool(per_turn_returns), verbose
        self.chat_template_kwargs, self.tool_syntax = chat_template_kwargs, tool_syntax
        self.discount_fn = discount_fn
        # Shared by the shallow copies GroupedWorkflow makes: one server per engine, one set of counters.
        self._shared: Dict[str, Any] = {"servers": [], "lock": threading.Lock(), "stats": Counter()}
        if server is not None:
            self._shared["servers"].append((None, server))

    @property
    def stats(self) -> Counter:
        """episodes, trained, rejected_empty, rejected_error, agent_errors, reward_errors."""
        return self._shared["stats"]

    def server_for(self, engine) -> ChatServer:
        """The chat server in front of `engine` (the one given to the constructor, or one started for it)."""
        with self._shared["lock"]:
            for owner, server in self._shared["servers"]:
                if owner is None or owner is engine:
                    return server
            server = ChatServer(
                engine,
                self.tokenizer,
                self.gconfig,
                self.model,
                chat_template_kwargs=self.chat_template_kwargs,
                tool_syntax=self.tool_syntax,
            ).start()
            self._shared["servers"].append((engine, server))
            return server

    def close(self) -> None:
        """Stop the servers this workflow started (a server passed in is left to its owner)."""
        with self._shared["lock"]:
            started = [s for owner, s in self._shared["servers"] if owner is not None]
            self._shared["servers"] = [(o, s) for o, s in self._shared["servers"] if o is None]
        for server in started:
            server.stop()

    async def _run_agent(self, data: Any, server: ChatServer, session: ChatSession) -> Any:
        async with _http_client() as http:
            kwargs = {"base_url": server.base_url, "api_key": session.api_key, "http_client": http}
            try:
                return await asyncio.wait_for(self.agent.run(data, **kwargs), self.timeout)
            except asyncio.TimeoutError:
                raise _AgentFailure(f"the agent ran past timeout={self.timeout}s") from None
            except Exception as e:
                if self.on_error == "raise":
                    raise
                raise _AgentFailure(f"the agent raised {type(e).__name__}: {e}") from e

    def _assign(self, session: ChatSession, result: Any) -> None:
        """The agent's return value -> rewards in the cache; _AgentFailure when it is not a valid reward."""
        cache = session.cache
        if not isinstance(result, (numbers.Real, Mapping)) or isinstance(result, bool):
            raise _AgentFailure(f"the agent returned {type(result).__name__}, not a float or a dict of rewards")
        try:  # set_reward refuses a non-finite reward; float(10**400) raises OverflowError
            if isinstance(result, Mapping):
                for cid, r in result.items():
                    cache.set_reward(cid, r)
            else:
                cache.set_last_reward(float(result))
        except (KeyError, TypeError, ValueError, ArithmeticError) as e:
            raise _AgentFailure(f"the agent's reward is invalid: {type(e).__name__}: {e}") from None

    def _fail(self, session: ChatSession, data: Any, reason: str, key: str) -> bool:
        """Log and count a failure; True when the episode still trains (with reward 0.0).

        A failure is an agent that raises or runs past `timeout`, or a reward that is not a number or a dict of
        known completion ids. With `on_error="zero"` the episode trains with reward 0.0 when it made completions (a
        crash on the model's own output is the policy's fault) and is rejected when it made none; "reject" always
        rejects; "raise" re-raises."""
        self.stats[key] += 1
        if self.on_error == "raise":
            raise RuntimeError(reason)
        trains = self.on_error == "zero" and len(session.cache) > 0
        what = "training it with reward 0.0" if trains else "episode rejected"
        logger.warning("%s (%d completions; %s); data %.200s", reason, len(session.cache), what, data)
        if trains:
            for it in session.cache.values():
                it.reward = None
            session.cache.set_last_reward(0.0)
        return trains

    def _discount(self, session: ChatSession) -> None:
        """The cache's `apply_reward_discount(turn_discount)`, or `discount_fn(rewards, turn_discount)`: the
        session's rewards in finishing order (None where none was set) -> the discounted ones. Notebook
        09_openai_agent trains with the learner's function this way, so the discount a learner writes is the one
        that trains."""
        if self.discount_fn is None:
            session.cache.apply_reward_discount(self.turn_discount)
            return
        items = list(session.cache.values())  # finishing order, as the cache's own walk
        discounted = list(self.discount_fn([it.reward for it in items], self.turn_discount))
        if len(discounted) != len(items):
            raise ValueError(f"discount_fn returned {len(discounted)} rewards for {len(items)} completions")
        for it, r in zip(items, discounted):
            it.reward = float(r)

    async def arun_episode(self, engine: InferenceEngine, data: Mapping[str, Any]) -> Optional[Dict[str, torch.Tensor]]:
        self.stats["episodes"] += 1
        server = self.server_for(engine)
        session = server.open_session(self.gconfig.new(n_samples=1))
        try:
            try:
                result, failure = await self._run_agent(data, server, session), None
            except _AgentFailure as e:
                result, failure = None, ("agent_errors", str(e))
        finally:
            server.close_session(session.api_key)
        if failure is None and session.cache:
            try:
                self._assign(session, result)
            except _AgentFailure as e:
                failure = ("reward_errors", str(e))
        if failure is not None and not self._fail(session, data, failure[1], failure[0]):
            self.stats["rejected_error"] += 1
            return None
        if not session.cache:
            logger.warning("the agent made no chat completion: episode rejected; data %.200s", data)
            self.stats["rejected_empty"] += 1
            return None
        self._discount(session)
        rows = session.cache.export_interactions(self.export_style)
        if self.verbose:
            print(f"[OpenAIAgent] {len(session.cache)} completions, {len(rows)} rows, stats {dict(session.stats)}")
        self.stats["trained"] += 1
        return interactions_to_batch(rows, self.export_style, self.per_turn_returns)
