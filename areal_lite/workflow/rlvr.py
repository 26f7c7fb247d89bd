"""`RLVRWorkflow`: one generation scored by a verifiable reward, with AReaL 1.0.4's name, path and constructor.

Design decisions (shared by every kit workflow, which import the helpers here):
- Every workflow builds its row through `TrajectoryBuilder`, the one place that appends tokens, and sends
  `builder.context()` as the next request. Generated tokens are appended as returned and never re-tokenized (a
  decode/encode round trip can give other ids, and the trainer would then score tokens the model never sampled).
- Rewards have AReaL's signature, `reward_fn(prompt, completions, prompt_ids, completion_ids, **data)`, and run
  through `AsyncRewardWrapper` (worker processes, timeout): a reward that hangs or crashes scores 0.0 and the
  rollout survives. The completion is decoded with special tokens skipped.
- A workflow samples one trajectory per call and sends `gconfig.new(n_samples=1)`; the group is the engine's
  `group_size=` (AReaL's rule), so a config's `n_samples` can be passed there unchanged.
- Every workflow returns the key `rewards` (`[1]` float32), the name the actor reads.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from areal_lite.api.cli_args import GenerationHyperparameters
from areal_lite.api.engine_api import InferenceEngine
from areal_lite.api.io_struct import ModelRequest, ModelResponse
from areal_lite.api.reward_api import AsyncRewardWrapper
from areal_lite.api.workflow_api import RolloutWorkflow
from areal_lite.utils.hf_utils import chat_prompt_ids
from areal_lite.utils.trajectory import TrajectoryBuilder

__all__ = ["TensorDict", "default_data_extract_prompt_fn", "default_get_input_ids_fn", "RLVRWorkflow"]


TensorDict = Dict[str, torch.Tensor]


def _messages_of(data: Mapping[str, Any], system_prompt: Optional[str] = None) -> List[Dict[str, Any]]:
    """`data["messages"]`, or a user message built from `data["question"]`; a system prompt goes first."""
    if "messages" in data and data["messages"] is not None:
        messages = [dict(m) for m in data["messages"]]
    elif "question" in data:
        messages = [{"role": "user", "content": str(data["question"])}]
    else:
        raise KeyError(f"data needs 'messages' or 'question'; it has keys {sorted(data)}")
    if system_prompt is not None and not (messages and messages[0].get("role") == "system"):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def _answer_of(data: Mapping[str, Any]):
    if "answer" not in data:
        raise KeyError(f"data needs an 'answer' for the reward; it has keys {sorted(data)}")
    return data["answer"]


def _single(gconfig: GenerationHyperparameters) -> GenerationHyperparameters:
    """The gconfig of one request. A workflow samples one trajectory per call, whatever `n_samples` says: the group
    is the engine's `group_size=` (AReaL's rule), so a config's `n_samples` can be passed there unchanged."""
    return gconfig.new(n_samples=1)


def _reward_wrapper(reward_fn, timeout: float) -> AsyncRewardWrapper:
    if isinstance(reward_fn, AsyncRewardWrapper):
        return reward_fn
    return AsyncRewardWrapper(reward_fn, timeout_seconds=timeout)


def default_data_extract_prompt_fn(data: Mapping[str, Any]) -> List[Dict[str, Any]]:
    """The chat messages of a data row: `data["messages"]`, or one user message built from `data["question"]`."""
    return _messages_of(data)


def default_get_input_ids_fn(messages, tokenizer, enable_thinking: bool) -> List[int]:
    """Prompt token ids: the chat template with the generation prompt (AReaL passes `enable_thinking` always;
    templates that do not use it ignore it)."""
    return chat_prompt_ids(tokenizer, messages, enable_thinking=enable_thinking)


class RLVRWorkflow(RolloutWorkflow):
    """Single turn with a verifiable reward: chat prompt -> one generation -> reward.

    AReaL 1.0.4's constructor and reward call: `reward_fn(prompt, completions, prompt_ids, completion_ids, **data)`
    runs in a worker process through `AsyncRewardWrapper` (a timeout or a crash scores 0.0). Kit extras are
    keyword-only: `reward_timeout`, `system_prompt` (prepended unless the row has one), `verbose`.
    """

    def __init__(
        self,
        reward_fn: Callable[..., float],
        gconfig: GenerationHyperparameters,
        tokenizer,
        enable_thinking: bool = False,
        get_input_ids_fn: Callable[..., List[int]] = default_get_input_ids_fn,
        data_extract_prompt_fn: Callable[[Mapping[str, Any]], Any] = default_data_extract_prompt_fn,
        *,
        reward_timeout: float = 15.0,
        system_prompt: Optional[str] = None,
        verbose: bool = False,
    ):
        self.reward_fn = reward_fn
        self.async_reward_fn = _reward_wrapper(reward_fn, reward_timeout)
        self.gconfig = gconfig
        self.tokenizer = tokenizer
        self.enable_thinking = enable_thinking
        self.get_input_ids_fn = get_input_ids_fn
        self.data_extract_prompt_fn = data_extract_prompt_fn
        self.system_prompt = system_prompt
        self.verbose = verbose

    def _template_kwargs(self) -> Dict[str, Any]:
        return {"enable_thinking": self.enable_thinking}

    def prompt_ids(self, data: Mapping[str, Any]) -> List[int]:
        """The prompt's token ids (chat template with the generation prompt)."""
        messages = self.data_extract_prompt_fn(data)
        if self.system_prompt is not None and not (messages and messages[0].get("role") == "system"):
            messages = [{"role": "system", "content": self.system_prompt}] + list(messages)
        return self.get_input_ids_fn(messages, self.tokenizer, self.enable_thinking)

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    async def reward(self, resp: ModelResponse, data: Mapping[str, Any]) -> float:
        """AReaL's reward call: prompt and completion as text and as ids, then the data row's fields."""
        prompt = self.tokenizer.decode(list(resp.input_tokens))
        completion = self.decode(resp.output_tokens)
        return float(await self.async_reward_fn(prompt, completion, resp.input_tokens, resp.output_tokens, **data))

    def request(self, input_ids: List[int], rid: Optional[str] = None, **metadata) -> ModelRequest:
        return ModelRequest(
            rid=rid or uuid.uuid4().hex,
            input_ids=input_ids,
            gconfig=_single(self.gconfig),
            metadata=metadata,
            tokenizer=self.tokenizer,
        )

    async def arun_episode(self, engine: InferenceEngine, data: Mapping[str, Any]) -> TensorDict:
        builder = TrajectoryBuilder().add_prompt(self.prompt_ids(data))
        resp: ModelResponse = await engine.agenerate(self.request(builder.context()))
        builder.add_output(resp)
        reward = await self.reward(resp, data)
        if self.verbose:
            print(
                f"[RLVR] completion={self.decode(resp.output_tokens)!r}\n[RLVR] answer={data.get('answer')!r} "
                f"reward={reward}"
            )
        return builder.to_tensors(reward)
