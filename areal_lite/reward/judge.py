"""A relative judge for a GRPO group, after ART's RULER: a judge model ranks the group's answers against each other.

Design decisions
- Relative and listwise: the judge sees a group's distinct answers at once, labelled A, B, C, ..., and names the
  best one. GRPO only uses how an answer compares with the rest of its group, so a judge needs no absolute scale.
  Identical answers share one label, so they always score the same.
- Votes over shuffles: the judge is asked `votes` times, each time with the answers in another order (drawn from
  `seed`, the question and the answers, so a group is judged the same way every time), greedily. An answer's score
  is its share of the votes. Small judges pick by position as much as by content; shuffling spreads that bias over
  the answers instead of paying one position.
- A reply names its choice by a candidate letter at its start ("B", "(B)", "B: ...") or after "answer"
  ("Answer: B", "the answer is B"); anything else abstains: a word such as "I" or "A" is no vote. A vote whose
  request fails abstains too, counted in `Verdict.errors`. A group whose votes all abstain scores 0.0 everywhere:
  no signal, and no crash.
- The judge is any `InferenceEngine`: in notebook 12 a second embedded server holding the frozen base model.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import string
import uuid
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from areal_lite.api.cli_args import GenerationHyperparameters
from areal_lite.api.engine_api import InferenceEngine
from areal_lite.api.io_struct import ModelRequest
from areal_lite.utils.hf_utils import chat_prompt_ids

__all__ = ["JUDGE_INSTRUCTION", "GroupJudge", "Verdict", "pairwise_agreement", "parse_choice"]

log = logging.getLogger("areal_lite.reward.judge")

JUDGE_INSTRUCTION = "Which candidate answer is correct? Reply with its letter only."


def parse_choice(text: str, n: int) -> Optional[int]:
    """The index of the candidate letter (one of the first `n`) that `text` names, or None (see the module
    docstring): "B", "(B)", "B: ...", "Answer: B", "The correct answer is (B)."; not "I cannot tell"."""
    letters = string.ascii_uppercase[:n]
    if not n or not isinstance(text, str):
        return None
    at_start = re.match(rf"\s*[(\[]?([{letters}])[)\]]?(?:\s*$|\s*\n|[.:,)\]-])", text)
    named = at_start or re.search(rf"(?i:answer)(?:\s+is)?\s*[:\-]?\s*[(\[]?([{letters}])(?![A-Za-z])", text)
    return None if named is None else letters.index(named.group(1))


@dataclass
class Verdict:
    """A group judged: one score per answer (its distinct answer's vote share), and each vote (None: abstained)."""

    scores: List[float]
    distinct: List[str]
    votes: List[Optional[int]]  # per vote, the index into `distinct` it chose
    errors: int = 0  # votes whose request failed (they abstain)


class GroupJudge:
    """Score a group of answers to one question relative to each other (see the module docstring).

    Args:
        engine: the judge's inference engine (another server than the policy's: the judge must stay frozen).
        tokenizer: the judge model's tokenizer (its chat template renders the question).
        votes: how many times the judge is asked, each with the answers shuffled.
        seed: the shuffles' seed.
        instruction: what the judge is asked after the candidates.
        max_new_tokens: the judge's reply budget per vote (its answer is one candidate's number).

    ```python
    judge = GroupJudge(judge_engine, tokenizer, votes=4)
    verdict = await judge.judge("What is 2 + 3?", ["5", "6", "5"])  # verdict.scores: one per answer
    ```
    """

    def __init__(
        self,
        engine: InferenceEngine,
        tokenizer,
        votes: int = 4,
        seed: int = 0,
        instruction: str = JUDGE_INSTRUCTION,
        max_new_tokens: int = 8,
    ):
        if votes < 1:
            raise ValueError(f"votes must be >= 1, got {votes}")
        self.engine, self.tokenizer = engine, tokenizer
        self.votes, self.seed, self.instruction = int(votes), seed, instruction
        self.gconfig = GenerationHyperparameters(
            greedy=True, max_new_tokens=max_new_tokens
        ).new_with_stop_and_pad_token_ids(tokenizer)

    def messages(self, question: str, candidates: Sequence[str]) -> List[Dict[str, str]]:
        """The judge's prompt: the question, the candidates labelled A, B, ..., the instruction."""
        if len(candidates) > len(string.ascii_uppercase):
            raise ValueError(f"at most 26 candidates, got {len(candidates)}")
        listed = "\n".join(f"{string.ascii_uppercase[i]}: {c}" for i, c in enumerate(candidates))
        return [{"role": "user", "content": f"Question: {question}\nCandidate answers:\n{listed}\n{self.instruction}"}]

    def orders(self, question: str, distinct: Sequence[str]) -> List[List[int]]:
        """One order of the distinct answers per vote, the same for the same group every time."""
        rng = random.Random(f"{self.seed}|{question}|{list(distinct)}")
        orders = []
        for _ in range(self.votes):
            order = list(range(len(distinct)))
            rng.shuffle(order)
            orders.append(order)
        return orders

    async def _vote(self, question: str, distinct: Sequence[str], order: List[int]) -> Optional[int]:
        ids = chat_prompt_ids(self.tokenizer, self.messages(question, [distinct[i] for i in order]))
        req = ModelRequest(rid=uuid.uuid4().hex, input_ids=ids, gconfig=self.gconfig, tokenizer=self.tokenizer)
        resp = await self.engine.agenerate(req)
        text = self.tokenizer.decode(list(resp.output_tokens), skip_special_tokens=True)
        choice = parse_choice(text, len(distinct))
        return None if choice is None else order[choice]

    async def _vote_or_error(
        self, question: str, distinct: Sequence[str], order: List[int]
    ) -> Optional[int] | Exception:
        """A vote, or the exception its request raised: a judge server that fails one request costs that vote,
        not the group (nor the training step that waits for it)."""
        try:
            return await self._vote(question, distinct, order)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.warning("judge vote failed (it abstains): %s: %s", type(e).__name__, e)
            return e

    async def judge(self, question: str, answers: Sequence[str]) -> Verdict:
        """Each answer's share of the judge's votes among the group's distinct answers."""
        answers = [(a or "").strip() for a in answers]  # None (an empty reply) is the empty answer
        distinct = list(dict.fromkeys(answers))
        if len(distinct) == 1:  # nothing to compare: every answer ties
            return Verdict([0.0] * len(answers), distinct, [])
        orders = self.orders(question, distinct)
        results = await asyncio.gather(*(self._vote_or_error(question, distinct, o) for o in orders))
        votes = [None if isinstance(r, Exception) else r for r in results]
        counted = [v for v in votes if v is not None]
        share = [counted.count(i) / len(counted) if counted else 0.0 for i in range(len(distinct))]
        errors = sum(isinstance(r, Exception) for r in results)
        return Verdict([share[distinct.index(a)] for a in answers], distinct, votes, errors)


def pairwise_agreement(judged: Sequence[float], truth: Sequence[float]) -> Dict[str, int]:
    """Over the pairs of one group whose true rewards differ: how often the judge orders them the same way
    (`agree`), the other way (`disagree`), or scores them equal (`tie`)."""
    out = {"agree": 0, "disagree": 0, "tie": 0}
    for i in range(len(truth)):
        for j in range(i + 1, len(truth)):
            if truth[i] == truth[j]:
                continue
            d = (judged[i] - judged[j]) * (truth[i] - truth[j])
            out["agree" if d > 0 else "disagree" if d < 0 else "tie"] += 1
    return out
