"""`MultiTurnFeedbackWorkflow`: after a wrong answer the model reads feedback and tries again (notebook 06).

Each turn's tokens carry its own discounted return (`token_returns`, from `utils.functional.discounted_returns`), so
a turn is credited for what followed it; AReaL's `MultiTurnWorkflow` gives one discounted reward per row instead.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import uuid
from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Optional

from areal_lite.api.cli_args import GenerationHyperparameters
from areal_lite.api.engine_api import InferenceEngine
from areal_lite.api.io_struct import ModelResponse
from areal_lite.utils.functional import discounted_returns
from areal_lite.utils.hf_utils import chat_turn_fragments
from areal_lite.utils.trajectory import TrajectoryBuilder
from areal_lite.workflow.rlvr import RLVRWorkflow, TensorDict

logger = logging.getLogger(__name__)

__all__ = ["FEEDBACK_CORRECT", "FEEDBACK_WRONG", "MultiTurnFeedbackWorkflow"]


FEEDBACK_CORRECT = "Congratulations! You are correct!"


FEEDBACK_WRONG = "Unfortunately your answer is wrong. Let's try again."


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

    `returns_fn(turn_rewards, turn_discount) -> returns` computes the G_k (default `discounted_returns`): notebook 06
    passes the learner's own, so that what trains is the function the learner wrote.

    How per-turn returns reach the loss (the convention `areal_lite.engine.fsdp_engine` implements): when a batch has
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
        returns_fn: Callable[[List[float], float], List[float]] = discounted_returns,
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
        self.returns_fn = returns_fn
        self.feedback_text = {True: feedback_correct, False: feedback_wrong}
        kw = self._template_kwargs()
        self.feedback = {ok: chat_turn_fragments(tokenizer, text, **kw) for ok, text in self.feedback_text.items()}

    def turn_reward(self, success: float) -> float:
        """`r = ((success - 0.5) * 2 - bias) * scale` (success 1 -> +1, 0 -> -1 before bias/scale)."""
        return ((success - 0.5) * 2.0 - self.reward_bias) * self.reward_scaling

    async def arun_episode(self, engine: InferenceEngine, data: Mapping[str, Any]) -> TensorDict:
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
        returns = [float(g) for g in self.returns_fn(turn_rewards, self.turn_discount)]
        solved = any(s > 0.5 for s in successes)
        turns = next(k + 1 for k, s in enumerate(successes) if s > 0.5) if solved else len(successes)
        if self.dump_dir is not None:
            try:
                self._dump(engine, data, rid, responses, successes, turn_rewards, returns)
            except OSError as e:  # a full disk or a folder gone costs the log line, not the episode
                logger.warning("could not write the episode log to %s: %s", self.dump_dir, e)
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
