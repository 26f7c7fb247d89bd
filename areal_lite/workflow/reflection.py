"""`ReflectionWorkflow`: answer, then read a request to check the answer and answer again (notebook 03).

The text inserted between turns is pre-tokenized once from the chat template (`utils.hf_utils.chat_turn_fragments`),
so the decoded trajectory equals the chat template of the whole conversation. The final reward is the last turn's
reward times `turn_discount ** (turns - 1)`: a later success is worth less.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any, Callable, Optional

from areal_lite.api.cli_args import GenerationHyperparameters
from areal_lite.api.engine_api import InferenceEngine
from areal_lite.api.io_struct import ModelResponse
from areal_lite.utils.hf_utils import chat_turn_fragments
from areal_lite.utils.trajectory import TrajectoryBuilder
from areal_lite.workflow.rlvr import RLVRWorkflow, TensorDict

__all__ = ["REFLECTION_PROMPT", "ReflectionWorkflow"]


REFLECTION_PROMPT = (
    "Your answer is either wrong or not parsable by the reward function. Think again and give your final answer."
)


class ReflectionWorkflow(RLVRWorkflow):
    """Answer; while the reward is 0 and turns remain, append a pre-tokenized reflection request and answer again.

    Final reward = last turn's reward x `turn_discount ** (turns - 1)`: a later success is worth less. "Wrong" means
    reward <= 0. The constructor starts like AReaL's `MultiTurnWorkflow(reward_fn, gconfig, tokenizer, max_turns,
    turn_discount)`, the closest AReaL workflow; it differs in the glue between turns: AReaL appends one EOS token and
    a fragment cut from a two-message template, the kit the template's own end-of-turn tokens (see
    `chat_turn_fragments`), so the decoded trajectory equals the chat template of the whole conversation.
    """

    def __init__(
        self,
        reward_fn: Callable[..., float],
        gconfig: GenerationHyperparameters,
        tokenizer,
        max_turns: int = 3,
        turn_discount: float = 0.9,
        *,
        reflection_prompt: str = REFLECTION_PROMPT,
        enable_thinking: bool = False,
        reward_timeout: float = 15.0,
        system_prompt: Optional[str] = None,
        verbose: bool = False,
    ):
        super().__init__(
            reward_fn,
            gconfig,
            tokenizer,
            enable_thinking,
            reward_timeout=reward_timeout,
            system_prompt=system_prompt,
            verbose=verbose,
        )
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.max_turns = int(max_turns)
        self.turn_discount = float(turn_discount)
        self.reflection_prompt = reflection_prompt
        # Tokenized once: the reflection turn's ids never depend on what the model wrote.
        self.fragments = chat_turn_fragments(tokenizer, reflection_prompt, **self._template_kwargs())

    async def arun_episode(self, engine: InferenceEngine, data: Mapping[str, Any]) -> TensorDict:
        builder = TrajectoryBuilder().add_prompt(self.prompt_ids(data))
        rid = uuid.uuid4().hex
        reward = 0.0
        resp: Optional[ModelResponse] = None
        for turn in range(self.max_turns):
            if turn > 0:
                builder.add_observation(self.fragments.after_output(resp.output_tokens), kind="reflection")
            resp = await engine.agenerate(self.request(builder.context(), rid=rid, turn=turn))
            builder.add_output(resp)
            reward = await self.reward(resp, data)
            if self.verbose:
                print(f"[Reflection] turn {turn}: reward={reward} completion={self.decode(resp.output_tokens)!r}")
            if reward > 0:
                break
        discounted = reward * self.turn_discount ** (builder.num_turns - 1)
        return builder.to_tensors(discounted)
