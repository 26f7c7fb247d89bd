"""Rollout workflows (AReaL's names): how one episode turns a data item into training tensors.

A workflow subclasses `RolloutWorkflow` and implements `async arun_episode(engine, data) -> dict[str, Tensor] | None`.
It asks the engine for tokens (`await engine.agenerate(ModelRequest)`), talks to tools or checkers, and returns the
tensor contract of `areal_lite.trajectory` (one row, or G contiguous rows for a group). None means "rejected".

Design decisions:
- Every workflow builds its row through `TrajectoryBuilder`, the one place that appends tokens, and sends
  `builder.context()` as the next request. Generated tokens are appended as returned and never re-tokenized (a
  decode/encode round trip can give other ids, and the trainer would then score tokens the model never sampled);
  only new text (tool results, feedback) is tokenized.
- Prompts go through `apply_chat_template(..., tokenize=True, add_generation_prompt=True)`, so they end with the
  assistant header the model continues from. With transformers 5 that call returns a BatchEncoding;
  `chat_prompt_ids` normalises it to `list[int]`.
- Text inserted between turns (reflection request, feedback) is pre-tokenized once in `__init__` from the chat
  template, as two fragments: the end-of-turn tokens that close an assistant message (ChatML: `<|im_end|>\\n`) and
  the user message plus the next assistant header. After each output we append only the part of the end-of-turn
  fragment the output did not already produce (an output that stopped on EOS ends with `<|im_end|>` and needs only
  `\\n`; one cut by length needs both). The decoded trajectory then equals the chat template of the whole
  conversation.
- Rewards have AReaL's signature, `reward_fn(prompt, completions, prompt_ids, completion_ids, **data)`, and run
  through `AsyncRewardWrapper` (worker processes, timeout): a reward that hangs or crashes scores 0.0 and the
  rollout survives. The completion is decoded with special tokens skipped.
- Every workflow returns the key `rewards` (`[1]` float32), the name the actor reads.
- A workflow samples one trajectory per call and sends `gconfig.new(n_samples=1)`; the group is the engine's
  `group_size=` (AReaL's rule), so `rollout_batch(rows, wf, group_size=config.gconfig.n_samples)` gives G rows per
  row. `GroupedWorkflow` is the same wrapper, usable on its own.
- A failing or slow search server becomes an `<information>search failed: ...</information>` observation the model
  can read, not an exception: one flaky tool call must not kill a batch.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import threading
import uuid
from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from areal_lite.api.cli_args import GenerationHyperparameters
from areal_lite.api.io_struct import ModelRequest, ModelResponse
from areal_lite.api.reward_api import AsyncRewardWrapper
from areal_lite.api.workflow_api import RolloutWorkflow
from areal_lite.reward import f1_score

from .tools import SearchToolError, call_search_tool, format_search_results, parse_answer, parse_search_query
from .trajectory import TrajectoryBuilder, concat_padded_tensors

__all__ = [
    "RLVRWorkflow",
    "ReflectionWorkflow",
    "SearchAgentWorkflow",
    "MultiTurnFeedbackWorkflow",
    "GroupedWorkflow",
    "PROMPT_TEMPLATE",
    "REFLECTION_PROMPT",
    "FEEDBACK_CORRECT",
    "FEEDBACK_WRONG",
    "chat_prompt_ids",
    "ChatTurnFragments",
    "chat_turn_fragments",
    "discounted_returns",
    "TokenRangeWorkflow",
]

logger = logging.getLogger(__name__)

TensorDict = Dict[str, torch.Tensor]

# The search agent's prompt, in the Search-R1 / ASearcher style: it names the tags the parsers look for and ends
# inside the assistant's first `<think>`, so the first generated token already continues a thought.
PROMPT_TEMPLATE = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant answers it. The "
    "Assistant analyzes the given question and information in the mind, retains important relevant information, "
    "calls a search engine to find necessary information, and provides the user with the answer. The Assistant "
    "conducts search by <search> query </search> and the top search results will be returned between <information> "
    "and </information>. The reasoning processes are enclosed within <think> </think>. Finally, the Assistant "
    "provides answer inside <answer> and </answer>, i.e. <answer> answer here </answer>. If there are multiple "
    "queries, ensure all answers are enclosed within <answer> </answer>, separated with comma.\n\n"
    "User:\n{question}\n\nAssistant:\n<think>"
)

REFLECTION_PROMPT = (
    "Your answer is either wrong or not parsable by the reward function. Think again and give your final answer."
)
FEEDBACK_CORRECT = "Congratulations! You are correct!"
FEEDBACK_WRONG = "Unfortunately your answer is wrong. Let's try again."

# Content that no chat template changes, used to find where an assistant message's text ends inside the template.
_SENTINEL = "AREALLITESENTINEL7F3A"


# ------------------------------------------------------------------------------------------------ chat helpers


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


def chat_prompt_ids(tokenizer, messages: Sequence[Mapping[str, Any]], **template_kwargs) -> List[int]:
    """Token ids of `messages` through the chat template, ending with the assistant header."""
    out = tokenizer.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=True, **template_kwargs)
    return _as_id_list(out)


def _render(tokenizer, messages, add_generation_prompt: bool, **template_kwargs) -> str:
    out = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
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


def chat_turn_fragments(tokenizer, user_content: str, **template_kwargs) -> ChatTurnFragments:
    """Pre-tokenize, from the tokenizer's chat template, what follows an assistant message when a user replies.

    Rendered as text: T1 = template([user, assistant S]); T2 = template([user, assistant S, user R], generation
    prompt). The end-of-turn text is what T1 has after S; the user turn is T2 minus its prefix T1.
    """
    base = [{"role": "user", "content": "Question?"}, {"role": "assistant", "content": _SENTINEL}]
    t1 = _render(tokenizer, base, False, **template_kwargs)
    at = t1.rfind(_SENTINEL)
    if at < 0:
        raise ValueError("the chat template dropped the assistant message's content; cannot find the turn boundary")
    eot_text = t1[at + len(_SENTINEL) :]
    t2 = _render(tokenizer, base + [{"role": "user", "content": user_content}], True, **template_kwargs)
    if not t2.startswith(t1):
        raise ValueError(
            "the chat template re-renders earlier turns when a user message is added, so a fixed fragment cannot be "
            "pre-tokenized for it"
        )
    user_text = t2[len(t1) :]
    enc = lambda s: _as_id_list(tokenizer(s, add_special_tokens=False)) if s else []  # noqa: E731
    return ChatTurnFragments(enc(eot_text), enc(user_text), eot_text, user_text)


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


def discounted_returns(rewards: Sequence[float], gamma: float) -> List[float]:
    """Turn-level returns `G_k = r_k + gamma * G_{k+1}` (last turn: `G = r`)."""
    out = [0.0] * len(rewards)
    running = 0.0
    for k in reversed(range(len(rewards))):
        running = float(rewards[k]) + gamma * running
        out[k] = running
    return out


# ------------------------------------------------------------------------------------------------ workflows


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

    async def arun_episode(self, engine, data: Mapping[str, Any]) -> TensorDict:
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

    async def arun_episode(self, engine, data: Mapping[str, Any]) -> TensorDict:
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


class SearchAgentWorkflow(RolloutWorkflow):
    """A search agent: think, `<search>` the RAG server, read `<information>`, then `<answer>`.

    Each turn generates until `</search>`, `</answer>` or EOS. A search query is sent to the RAG server
    (`POST /retrieve`) and its passages are appended as an `<information>` block (loss 0). An answer ends the episode
    with reward = token F1 against the best of `data["answer"]` (a str or list of str); no answer scores 0.
    The episode also ends on EOS, after `max_turns` generations, or when the context would exceed `max_tokens`
    (generation budgets are capped so the trajectory never does). A generation cut by `max_new_tokens` is continued
    by the next one, and tags are parsed in all text generated since the last observation, so a
    `<search>` opened in one generation and closed in the next still counts.
    """

    STOP = ("</search>", "</answer>")

    def __init__(
        self,
        tokenizer,
        gconfig: GenerationHyperparameters,
        rag_addr: Optional[str] = None,
        max_turns: int = 16,
        max_tokens: int = 4096,
        topk: int = 3,
        reward_mode: str = "set",
        search_timeout: float = 30.0,
        prompt_template: str = PROMPT_TEMPLATE,
        verbose: bool = False,
    ):
        if reward_mode not in ("set", "multiset"):
            raise ValueError(f"reward_mode must be 'set' or 'multiset', got {reward_mode!r}")
        if max_turns < 1 or max_tokens < 1 or topk < 1:
            raise ValueError("max_turns, max_tokens and topk must be >= 1")
        if "{question}" not in prompt_template:
            raise ValueError("prompt_template needs a {question} placeholder")
        self.tokenizer = tokenizer
        self.gconfig = gconfig
        self.rag_addr = rag_addr
        self.max_turns = int(max_turns)
        self.max_tokens = int(max_tokens)
        self.topk = int(topk)
        self.reward_mode = reward_mode
        self.search_timeout = float(search_timeout)
        self.prompt_template = prompt_template
        self.verbose = verbose

    def _encode(self, text: str) -> List[int]:
        return _as_id_list(self.tokenizer(text, add_special_tokens=False))

    def _request_gconfig(self, budget: int) -> GenerationHyperparameters:
        g = _single(self.gconfig)
        stop = list(g.stop or [])
        stop += [s for s in self.STOP if s not in stop]
        return g.new(stop=stop, max_new_tokens=max(1, min(g.max_new_tokens, budget)))

    async def _search(self, query: str) -> str:
        """The `<information>` block for `query`; failures become an error block the model can read."""
        if not query:
            return "\n\n<information>\nsearch failed: empty query\n</information>"
        try:
            docs = (await call_search_tool([query], topk=self.topk, addr=self.rag_addr, timeout=self.search_timeout))[0]
        except SearchToolError as e:
            logger.warning("search for %r failed: %s", query, e)
            return f"\n\n<information>\nsearch failed: {e}\n</information>"
        return format_search_results(docs)

    def _is_eos(self, token: int) -> bool:
        ends = {self.tokenizer.eos_token_id, self.tokenizer.pad_token_id} - {None}
        return token in ends

    async def arun_episode(self, engine, data: Mapping[str, Any]) -> TensorDict:
        if "question" not in data:
            raise KeyError(f"SearchAgentWorkflow needs data['question']; it has keys {sorted(data)}")
        golds = _answer_of(data)
        builder = TrajectoryBuilder().add_prompt(self._encode(self.prompt_template.format(question=data["question"])))
        if len(builder) >= self.max_tokens:
            raise ValueError(f"the prompt alone has {len(builder)} tokens, max_tokens is {self.max_tokens}")
        rid = uuid.uuid4().hex
        reward, answer, searches = 0.0, None, 0
        # Text generated since the last observation: a tag cut by a length stop is completed by the next turn.
        pending = ""
        while builder.num_turns < self.max_turns and len(builder) < self.max_tokens:
            g = self._request_gconfig(self.max_tokens - len(builder))
            req = ModelRequest(
                rid=rid,
                input_ids=builder.context(),
                gconfig=g,
                metadata={"turn": builder.num_turns},
                tokenizer=self.tokenizer,
            )
            resp = await engine.agenerate(req)
            builder.add_output(resp)
            pending += self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
            answer = parse_answer(pending)
            if answer is not None:
                reward = f1_score(answer, golds, mode=self.reward_mode)
                break
            query = parse_search_query(pending)
            if query is not None:
                obs = self._encode(await self._search(query))
                searches += 1
                if len(builder) + len(obs) >= self.max_tokens:
                    break  # no room left to read the results and still generate
                builder.add_observation(obs, kind="tool")
                pending = ""
                continue
            if not resp.output_tokens or self._is_eos(resp.output_tokens[-1]):
                break  # EOS (or nothing generated) without an answer: the episode is over
        if self.verbose:
            print(
                f"[SearchAgent] turns={builder.num_turns} searches={searches} tokens={len(builder)} "
                f"answer={answer!r} reward={reward:.3f}"
            )
        return builder.to_tensors(reward)


class MultiTurnFeedbackWorkflow(RLVRWorkflow):
    """A math agent that hears back after every answer: "correct" or "wrong, try again"; turn-level returns.

    Turn k's success s_k = clip(reward_fn(completion_k, answer), 0, 1) (1 = correct); its reward is
    `r_k = ((s_k - 0.5) * 2 - reward_bias) * reward_scaling` and its return `G_k = r_k + turn_discount * G_{k+1}`.
    Success maps to +1 and failure to -1 (not 0) so that a wrong answer carries a penalty of its own: with 0 for
    failure, a wrong answer followed by a right one would inherit a positive return from its successor. `reward_bias`
    shifts every turn's reward (a positive bias is a cost per extra answer), `reward_scaling` stretches it; with
    group normalisation of both mean and std the scale cancels. Feedback text goes in through the chat template as
    pre-tokenized fragments (outputs are never re-tokenized).

    Early stop (default `stop_on_correct=True`): the episode ends at the first correct answer. Running all
    `num_turns` after a success would train the model on turns that answer "Congratulations!" rather than the task,
    and let a late wrong answer drag down an earlier correct one. Stopping makes "correct sooner" strictly better:
    G_0 = 1 for a first-turn success, -1 + gamma for a second-turn one, and so on. `stop_on_correct=False` runs
    every turn, as the older multi-turn math agents did.

    Output: `rewards` [1] = G_0 (the first turn's return: a meaningful per-episode number for plots and for any
    actor that only reads `rewards`); `token_returns` [1, L] float32 = G_k on the generated tokens of turn k, 0.0 on
    prompt and feedback tokens; `turns` [1] float32 = answers up to and including the first correct one (all answers
    given when none was correct); `solved` [1] float32 = 1.0 when some answer was correct.

    `dump_dir`: when set, every episode appends one JSON line per answer to `{dump_dir}/v{version}.jsonl`, version
    being the policy version that generated the answer's first token: the question, the answer text, success, turn
    (1-based), reward r_k and return G_k. So what each policy version answered can be read back after training.
    Lines are written once the episode ends (its returns are known then), under a process-wide lock.

    How per-turn returns reach the loss (the convention `areal_lite.trainer.ppo.actor` implements): when a batch has
    `token_returns`, the actor uses it instead of broadcasting `rewards[i]` over row i. A turn is a maximal run of
    consecutive generated tokens (turns are separated by feedback tokens), and `token_returns` is constant on it.
    Each turn's return goes through the same reward shaping as `rewards` (`clip((G + bias) * scale)`), then
    `reward_norm` treats every (row, turn) pair as one sample: level "group" pools all turns of the G contiguous rows
    of a group ("batch": all turns of the batch), each turn counted once whatever its length. The normalised return
    is written back on the turn's tokens and is the advantage base: A_t = G^_t + sum of later KL rewards. Tokens of
    different turns of one row thus get different advantages: an early wrong answer is pushed down even when a
    later turn succeeds. In a group where every answer is wrong the returns differ only by how many wrong answers
    followed, so the last wrong turn ends above the group mean (with 0 for failure that group would teach nothing).
    (This workflow already applies its own `reward_scaling`/`reward_bias` per turn; leave the actor's at their
    defaults, 1 and 0, to avoid shaping twice.)
    """

    # One lock for the whole process: grouped copies of a workflow, and other instances writing to the same
    # dump_dir, may finish episodes in different threads' event loops.
    _dump_lock = threading.Lock()

    def __init__(
        self,
        reward_fn: Callable[..., float],
        gconfig: GenerationHyperparameters,
        tokenizer,
        num_turns: int = 3,
        turn_discount: float = 0.9,
        reward_scaling: float = 1.0,
        reward_bias: float = 0.0,
        feedback_correct: str = FEEDBACK_CORRECT,
        feedback_wrong: str = FEEDBACK_WRONG,
        stop_on_correct: bool = True,
        *,
        enable_thinking: bool = False,
        reward_timeout: float = 15.0,
        system_prompt: Optional[str] = None,
        verbose: bool = False,
        dump_dir: Optional[str] = None,
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
        if num_turns < 1:
            raise ValueError(f"num_turns must be >= 1, got {num_turns}")
        self.num_turns = int(num_turns)
        self.turn_discount = float(turn_discount)
        self.reward_scaling = float(reward_scaling)
        self.reward_bias = float(reward_bias)
        self.stop_on_correct = bool(stop_on_correct)
        self.dump_dir = None if dump_dir is None else os.fspath(dump_dir)
        self.feedback_text = {True: feedback_correct, False: feedback_wrong}
        kw = self._template_kwargs()
        self.feedback = {ok: chat_turn_fragments(tokenizer, text, **kw) for ok, text in self.feedback_text.items()}

    def turn_reward(self, success: float) -> float:
        """`r = ((success - 0.5) * 2 - bias) * scale` (success 1 -> +1, 0 -> -1 before bias/scale)."""
        return ((success - 0.5) * 2.0 - self.reward_bias) * self.reward_scaling

    async def arun_episode(self, engine, data: Mapping[str, Any]) -> TensorDict:
        builder = TrajectoryBuilder().add_prompt(self.prompt_ids(data))
        rid = uuid.uuid4().hex
        responses: List[ModelResponse] = []
        successes: List[float] = []
        correct = False
        resp: Optional[ModelResponse] = None
        for turn in range(self.num_turns):
            if turn > 0:
                builder.add_observation(self.feedback[correct].after_output(resp.output_tokens), kind="feedback")
            resp = await engine.agenerate(self.request(builder.context(), rid=rid, turn=turn))
            builder.add_output(resp)
            success = min(max(await self.reward(resp, data), 0.0), 1.0)
            correct = success > 0.5
            responses.append(resp)
            successes.append(success)
            if self.verbose:
                print(f"[MultiTurn] turn {turn}: success={success} completion={self.decode(resp.output_tokens)!r}")
            if correct and self.stop_on_correct:
                break
        turn_rewards = [self.turn_reward(s) for s in successes]
        returns = discounted_returns(turn_rewards, self.turn_discount)
        solved = any(s > 0.5 for s in successes)
        turns = next(k + 1 for k, s in enumerate(successes) if s > 0.5) if solved else len(successes)
        if self.dump_dir is not None:
            self._dump(engine, data, rid, responses, successes, turn_rewards, returns)
        return builder.to_tensors(
            returns[0], token_returns=builder.per_turn_values(returns), turns=turns, solved=float(solved)
        )

    def _dump(self, engine, data, rid, responses, successes, rewards, returns) -> None:
        """Append one JSON line per answer to `{dump_dir}/v{version}.jsonl` (see the class docstring)."""
        question = data.get("question")
        if question is None:
            question = self.data_extract_prompt_fn(data)[-1].get("content")
        lines: Dict[int, List[str]] = {}
        for k, resp in enumerate(responses):
            if resp.output_versions:
                version = int(resp.output_versions[0])
            else:  # an empty answer has no token to read the version from
                version = int(getattr(engine, "get_version", lambda: -1)())
            record = dict(
                version=version,
                episode=rid,
                turn=k + 1,
                question=question,
                answer=self.decode(resp.output_tokens),
                success=successes[k],
                reward=rewards[k],
                ret=returns[k],
                gold=data.get("answer"),
            )
            lines.setdefault(version, []).append(json.dumps(record, default=str) + "\n")
        with self._dump_lock:
            os.makedirs(self.dump_dir, exist_ok=True)
            for version, chunk in lines.items():
                with open(os.path.join(self.dump_dir, f"v{version}.jsonl"), "a", encoding="utf-8") as fh:
                    fh.write("".join(chunk))


class GroupedWorkflow(RolloutWorkflow):
    """Run `workflow` G times concurrently on the same data; return exactly G contiguous rows (a GRPO group).

    G is `workflow.gconfig.n_samples` unless `group_size` is given; giving both with different values (and
    n_samples != 1) is an error. The inner workflow is a shallow copy whose gconfig has `n_samples=1`.
    If any episode of the group is rejected (returns None) the whole group is rejected (None): a partial group
    would break the "G contiguous rows" layout that group normalisation relies on (AReaL 1.0.4's
    `GroupedRolloutWorkflow` keeps the survivors and returns a short group). If one raises, the others are
    cancelled and the exception propagates.
    """

    def __init__(self, workflow, group_size: Optional[int] = None, *, check_n_samples: bool = True):
        gconfig = getattr(workflow, "gconfig", None)
        n = getattr(gconfig, "n_samples", None)
        if group_size is None:
            if n is None:
                raise ValueError("the inner workflow has no gconfig.n_samples; pass group_size")
            group_size = n
        elif check_n_samples and n is not None and n != 1 and n != group_size:
            raise ValueError(
                f"group size given twice and they disagree: group_size={group_size} but gconfig.n_samples={n}; "
                "set it once (gconfig.n_samples)"
            )
        if int(group_size) < 1:
            raise ValueError(f"group size must be >= 1, got {group_size}")
        self.group_size = int(group_size)
        self.workflow = copy.copy(workflow)
        if gconfig is not None:
            self.workflow.gconfig = gconfig.new(n_samples=1)
            self.gconfig = gconfig.new(n_samples=self.group_size)

    async def arun_episode(self, engine, data: Mapping[str, Any]) -> Optional[TensorDict]:
        tasks = [asyncio.ensure_future(self.workflow.arun_episode(engine, data)) for _ in range(self.group_size)]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        if any(r is None for r in results):
            return None
        return concat_padded_tensors(results)


class TokenRangeWorkflow(RolloutWorkflow):
    """A toy task a tiny *random* model can learn in seconds: reward = fraction of output ids in [lo, hi).

    Used by the end-to-end training test and `bench/async_vs_sync.py`, where a real task would need a real model.
    The prompt is `data["question"]` through the chat template; one generation; no reward worker process.
    """

    def __init__(self, tokenizer, gconfig: GenerationHyperparameters, lo: int = 100, hi: int = 1124):
        self.tokenizer, self.gconfig, self.lo, self.hi = tokenizer, gconfig, int(lo), int(hi)

    async def arun_episode(self, engine, data: Mapping[str, Any]) -> TensorDict:
        ids = chat_prompt_ids(self.tokenizer, [{"role": "user", "content": data["question"]}])
        req = ModelRequest(input_ids=ids, gconfig=_single(self.gconfig), tokenizer=self.tokenizer)
        resp = await engine.agenerate(req)
        out = resp.output_tokens
        reward = sum(self.lo <= t < self.hi for t in out) / max(1, len(out))
        return TrajectoryBuilder().add_prompt(ids).add_output(resp).to_tensors(reward)
