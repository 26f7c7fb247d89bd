"""`MultiTurnWorkflow` (AReaL 1.0.4's `areal.workflow.multi_turn`): answer again while the reward is 0.

AReaL's constructor, defaults, turn loop and return keys, so an AReaL experiment that uses it runs unchanged and a
greedy episode gives AReaL's batch token for token. That includes AReaL's glue between turns: the output, one EOS
token unless the output already ended with it, then a retry request cut from a two-message chat template
(`multi_turn_prompt_ids`). That glue is not the template's own end of turn (ChatML loses the newline after
`<|im_end|>`); `ReflectionWorkflow` is the kit's template-exact variant of the same loop.

Where the kit keeps its own rule (listed in `areal_lite.kit.areal.compat`):
- a reward that raises or hangs scores 0.0 (the kit's `AsyncRewardWrapper`), so the episode goes on to its next
  turn; AReaL re-raises the reward's exception on the last retry and the whole rollout fails;
- the reward's `completions` text is decoded with special tokens skipped, as in every kit workflow;
- no `stats_tracker` scalars (AReaL logs `reward` and `num_turns`): the kit has no stats tracker.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any, Callable, List

from areal_lite.api.cli_args import GenerationHyperparameters
from areal_lite.api.engine_api import InferenceEngine
from areal_lite.api.io_struct import ModelRequest, ModelResponse
from areal_lite.api.workflow_api import RolloutWorkflow
from areal_lite.utils.hf_utils import apply_chat_template, chat_prompt_ids
from areal_lite.utils.trajectory import TrajectoryBuilder
from areal_lite.workflow.rlvr import TensorDict, _reward_wrapper, _single, default_data_extract_prompt_fn

__all__ = ["RETRY_PROMPT", "MultiTurnWorkflow"]


# AReaL's text, word for word: it is part of the trajectory the policy trains on.
RETRY_PROMPT = (
    "Your answer is either wrong or not parsable to the reward function. You may misunderstand the original "
    "question. Please carefully read the original question, check the previous errors, and try to answer it again."
)


class MultiTurnWorkflow(RolloutWorkflow):
    """Multi-attempt workflow that retries generation until the reward is non-zero (AReaL's docstring says positive).

    Each turn sends the whole trajectory so far; while the reward is exactly 0.0 and turns remain, the output, an
    EOS token (unless the output ended with one) and `multi_turn_prompt_ids` are appended and the model answers
    again. The row's reward is the last turn's reward x `turn_discount ** (turns - 1)`; one row per episode with
    AReaL's keys (`input_ids`, `logprobs`, `loss_mask`, `versions`, `rewards`, `attention_mask`), loss 1 exactly
    on generated tokens. `data` needs `messages` (the kit also accepts `question`) and whatever the reward reads.

    `reward_fn(prompt, completions, prompt_ids, completion_ids, **data)` runs in a worker process through
    `AsyncRewardWrapper`; `reward_timeout` (keyword-only, kit extra) is its timeout, AReaL's default 15 s.
    """

    def __init__(
        self,
        reward_fn: Callable[..., Any],
        gconfig: GenerationHyperparameters,
        tokenizer,
        max_turns: int,
        turn_discount: float,
        *,
        reward_timeout: float = 15.0,
    ):
        if max_turns <= 0:
            raise ValueError("max_turns must be positive")
        if not (0.0 < turn_discount <= 1.0):
            raise ValueError("turn_discount must be in (0, 1].")
        self.reward_fn = reward_fn
        self.gconfig = gconfig.new_with_stop_and_pad_token_ids(tokenizer)
        self.tokenizer = tokenizer
        self.max_turns = max_turns
        self.turn_discount = turn_discount
        self.async_reward_fn = _reward_wrapper(reward_fn, reward_timeout)
        self.multi_turn_prompt_ids = self._retry_prompt_ids(tokenizer)

    @staticmethod
    def _retry_prompt_ids(tokenizer) -> List[int]:
        """AReaL's glue: template([assistant, user retry] + generation prompt) minus template([assistant]).

        Cutting one tokenized template from another avoids re-tokenizing the model's text and drops the system
        prompt a template may insert.
        """
        messages = [{"role": "assistant", "content": "some random message."}]
        s1 = apply_chat_template(tokenizer, messages, tokenize=True)
        messages = messages + [{"role": "user", "content": RETRY_PROMPT}]
        s2 = apply_chat_template(tokenizer, messages, tokenize=True, add_generation_prompt=True)
        return list(s2[len(s1) :])

    def _after_wrong_answer(self, output_tokens: List[int]) -> List[int]:
        """The tokens appended after an output that scored 0: EOS if the output did not end with it, then the retry
        request. An empty output gets no EOS (AReaL's rule); a tokenizer without EOS gets none either."""
        eos = self.tokenizer.eos_token_id
        closing = [eos] if output_tokens and eos is not None and output_tokens[-1] != eos else []
        return closing + self.multi_turn_prompt_ids

    async def _reward(self, resp: ModelResponse, data: Mapping[str, Any]) -> float:
        """AReaL's reward call; the prompt is the whole context of this turn, earlier turns included."""
        prompt = self.tokenizer.decode(list(resp.input_tokens))
        completion = self.tokenizer.decode(list(resp.output_tokens), skip_special_tokens=True)
        return float(await self.async_reward_fn(prompt, completion, resp.input_tokens, resp.output_tokens, **data))

    async def arun_episode(self, engine: InferenceEngine, data: Mapping[str, Any]) -> TensorDict:
        builder = TrajectoryBuilder().add_prompt(chat_prompt_ids(self.tokenizer, default_data_extract_prompt_fn(data)))
        reward, discount = 0.0, 1.0
        while reward == 0.0 and builder.num_turns < self.max_turns:
            # A fresh rid per turn, as AReaL: each turn is its own request.
            req = ModelRequest(
                rid=uuid.uuid4().hex,
                input_ids=builder.context(),
                gconfig=_single(self.gconfig),
                tokenizer=self.tokenizer,
            )
            resp: ModelResponse = await engine.agenerate(req)
            builder.add_output(resp)  # refuses a response generated from another context (AReaL asserts)
            reward = await self._reward(resp, data)
            if reward == 0.0 and builder.num_turns < self.max_turns:
                builder.add_observation(self._after_wrong_answer(resp.output_tokens), kind="retry")
                discount *= self.turn_discount
        return builder.to_tensors(reward * discount)
