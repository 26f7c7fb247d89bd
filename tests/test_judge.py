"""`GroupJudge`: a judge model ranks a GRPO group's answers relative to each other (notebook 12).

Parsing a reply into a choice, the vote shares (identical answers share one label and one score; a group whose
votes all abstain scores 0), the shuffles (every candidate order differs, and the same group is shuffled the same
way every time), and pairwise agreement with the true rewards. `LetterJudge` stands in for the judge *model*: it
answers with the letter of whichever candidate it is told to prefer, so what the judge code does with a reply is
checked exactly. The last test asks the real engine and server.
"""

from __future__ import annotations

import asyncio
import re

import pytest

from areal_lite.api.io_struct import ModelRequest, ModelResponse


class LetterJudge:
    """Replies `template.format(letter)` where letter labels the candidate `prefer(candidates)` picks."""

    def __init__(self, tok, prefer, template="{}"):
        self.tok, self.prefer, self.template, self.prompts = tok, prefer, template, []

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        prompt = self.tok.decode(req.input_ids)
        self.prompts.append(prompt)
        candidates = re.findall(r"^([A-Z]): (.*)$", prompt, re.M)
        letter = self.prefer(candidates)
        out = self.tok(self.template.format(letter), add_special_tokens=False)["input_ids"]
        return ModelResponse(input_tokens=list(req.input_ids), output_tokens=out, output_logprobs=[0.0] * len(out),
                             output_versions=[0] * len(out))  # fmt: skip


def first_position(candidates):
    return candidates[0][0]


def the_answer(value):
    return lambda candidates: next(letter for letter, text in candidates if text == value)


def judge_with(tok, prefer, **kw):
    from areal_lite.reward.judge import GroupJudge

    template = kw.pop("template", "{}")
    engine = LetterJudge(tok, prefer, template)
    return GroupJudge(engine, tok, **kw), engine


@pytest.mark.parametrize(
    "text, n, expected",
    [("B", 4, 1), ("(C)", 4, 2), ("Answer: A.", 4, 0), ("The answer is D", 4, 3), ("D", 3, None),
     ("Because", 4, None), ("", 4, None), ("a", 4, None), ("I think B or C", 4, None), ("A: 9 + 6 = 15", 4, 0),
     ("The correct answer is (B).", 4, 1), (" C.\n", 4, 2), ("I cannot decide", 10, None),
     ("A better answer is C", 4, 2), ("B is better", 4, None), (None, 4, None)],
)  # fmt: skip
def test_a_reply_names_its_choice_at_its_start_or_after_answer(text, n, expected):
    """The letter must stand where a choice is named: a word that is a candidate letter ("I", "A") is no vote."""
    from areal_lite.reward.judge import parse_choice

    assert parse_choice(text, n) == expected


def test_scores_are_vote_shares_and_identical_answers_tie(tok):
    judge, engine = judge_with(tok, the_answer("5"), votes=4)
    verdict = asyncio.run(judge.judge("What is 2 + 3?", ["5", "6", " 5", "7"]))
    assert verdict.distinct == ["5", "6", "7"]
    assert verdict.scores == [1.0, 0.0, 1.0, 0.0] and len(engine.prompts) == 4
    assert "Question: What is 2 + 3?" in engine.prompts[0] and "Reply with its letter only." in engine.prompts[0]


def test_shuffles_spread_a_position_bias_and_repeat_for_the_same_group(tok):
    judge, engine = judge_with(tok, first_position, votes=6, seed=1)
    answers = ["5", "6", "7"]
    verdict = asyncio.run(judge.judge("What is 2 + 3?", answers))
    assert sum(verdict.scores) == pytest.approx(1.0) and max(verdict.scores) < 1.0  # not all votes to one answer
    assert len({tuple(o) for o in judge.orders("What is 2 + 3?", answers)}) > 1
    again, _ = judge_with(tok, first_position, votes=6, seed=1)
    assert asyncio.run(again.judge("What is 2 + 3?", answers)).scores == verdict.scores


def test_abstentions_do_not_count_and_all_abstaining_scores_zero(tok):
    judge, _ = judge_with(tok, the_answer("5"), votes=3, template="I cannot tell.")
    assert asyncio.run(judge.judge("What is 2 + 3?", ["5", "6"])).scores == [0.0, 0.0]
    judge, _ = judge_with(tok, the_answer("6"), votes=3, template="Answer: {}")
    verdict = asyncio.run(judge.judge("What is 2 + 3?", ["5", "6"]))
    assert verdict.scores == [0.0, 1.0] and verdict.votes == [1, 1, 1]


def test_a_failed_vote_abstains_and_is_counted(tok):
    """A judge server that fails a request costs that vote, not the group (nor the training step waiting on it)."""
    judge, engine = judge_with(tok, the_answer("6"), votes=4)
    answered = engine.agenerate
    calls = []

    async def every_other_fails(req):
        calls.append(req)
        if len(calls) % 2:
            raise ConnectionError("judge server gone")
        return await answered(req)

    engine.agenerate = every_other_fails
    verdict = asyncio.run(judge.judge("What is 2 + 3?", ["5", "6", None]))
    assert verdict.errors == 2 and verdict.votes.count(None) == 2 and verdict.scores == [0.0, 1.0, 0.0]
    assert verdict.distinct == ["5", "6", ""]  # no answer (None) is the empty answer


def test_one_distinct_answer_needs_no_judge(tok):
    judge, engine = judge_with(tok, first_position)
    assert asyncio.run(judge.judge("Q?", ["5", "5 "])).scores == [0.0, 0.0] and not engine.prompts


def test_pairwise_agreement_counts_only_pairs_the_truth_orders():
    from areal_lite.reward.judge import pairwise_agreement

    assert pairwise_agreement([0.5, 0.25, 0.25, 0.0], [1, 0, 1, 0]) == {"agree": 3, "disagree": 0, "tie": 1}
    assert pairwise_agreement([0.0, 1.0], [1, 0]) == {"agree": 0, "disagree": 1, "tie": 0}
    assert pairwise_agreement([0.3, 0.7, 0.1], [1, 1, 1]) == {"agree": 0, "disagree": 0, "tie": 0}


def test_bad_arguments(tok):
    from areal_lite.reward.judge import GroupJudge

    with pytest.raises(ValueError, match="votes must be >= 1"):
        GroupJudge(None, tok, votes=0)
    with pytest.raises(ValueError, match="at most 26 candidates"):
        GroupJudge(None, tok).messages("Q?", [str(i) for i in range(27)])


def test_the_real_engine_answers_the_judge(engine, tok):
    """The tiny random model rarely writes a letter: whatever it says, the scores are shares and sum to at most 1."""
    from areal_lite.reward.judge import GroupJudge

    verdict = asyncio.run(GroupJudge(engine, tok, votes=3).judge("What is 2 + 3?", ["5", "6", "7"]))
    assert len(verdict.votes) == 3 and len(verdict.scores) == 3
    assert all(0.0 <= s <= 1.0 for s in verdict.scores) and sum(verdict.scores) <= 1.0 + 1e-9
