"""The kit's `MultiTurnWorkflow` (AReaL 1.0.4's `areal.workflow.multi_turn`) on its own terms.

tests/test_areal_conformance.py proves it gives AReaL's batch; here: the exact token layout of a row (glue, masks,
versions, discount), AReaL's loop rules (retry only on a reward of exactly 0.0, EOS added only when missing), and the
kit's rule that a failing reward scores 0.0 instead of killing the rollout. `ScriptedPolicy` replays fixed token
ids through `agenerate(ModelRequest) -> ModelResponse` (it stands in for the *model*), so an output that ends with
EOS, one cut by length and an empty one can each be chosen; the real engine runs the rest. Rewards are module-level
because `AsyncRewardWrapper` runs them in worker processes. Each worker imports this module to unpickle them, so
it imports nothing heavy at the top: torch (through the workflow) is imported inside the tests, where it costs the
test process once instead of every worker of every workflow's pool several seconds.
"""

from __future__ import annotations

import asyncio

import pytest

from areal_lite.api.cli_args import GenerationHyperparameters
from areal_lite.api.io_struct import ModelRequest, ModelResponse

QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]


def retries_to_third(prompt, completions, prompt_ids, completion_ids, **data):
    """1.0 once the prompt holds two retry requests (the third answer), else 0.0."""
    return float(prompt.count("try to answer it again") >= 2)


def always_zero(prompt, completions, prompt_ids, completion_ids, **data):
    return 0.0


def negative(prompt, completions, prompt_ids, completion_ids, **data):
    return -1.0


def crashing(prompt, completions, prompt_ids, completion_ids, **data):
    raise RuntimeError("reward bug")


def clean_text(prompt, completions, prompt_ids, completion_ids, **data):
    """1.0 when the completion text has no special token and the prompt is the decoded context."""
    return float("<|im_end|>" not in completions and prompt.endswith("<|im_start|>assistant\n"))


class ScriptedPolicy:
    """Returns the given output token ids, one list per call, with logprob -0.5 and version 3 on each."""

    def __init__(self, outputs):
        self.outputs, self.requests = [list(o) for o in outputs], []

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        self.requests.append(req)
        out = self.outputs[len(self.requests) - 1]
        return ModelResponse(
            input_tokens=list(req.input_ids),
            output_tokens=out,
            output_logprobs=[-0.5] * len(out),
            output_versions=[3] * len(out),
            stop_reason="stop",
        )


def gconfig():
    return GenerationHyperparameters(greedy=True, max_new_tokens=4)


@pytest.fixture
def make(tok):
    """`make(reward_fn, max_turns=, turn_discount=)`: a MultiTurnWorkflow on the tiny tokenizer; its reward workers
    are stopped when the test ends."""
    from areal_lite.workflow.multi_turn import MultiTurnWorkflow

    made = []

    def build(reward_fn, **kw):
        made.append(MultiTurnWorkflow(reward_fn, gconfig(), tok, **kw))
        return made[-1]

    yield build
    for wf in made:
        wf.async_reward_fn.shutdown()


def text_ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_constructor_follows_areal(tok, make):
    from areal_lite.workflow.multi_turn import RETRY_PROMPT

    wf = make(always_zero, max_turns=2, turn_discount=0.5)
    assert set(wf.gconfig.stop_token_ids) >= {tok.eos_token_id, tok.pad_token_id}
    glue = tok.decode(wf.multi_turn_prompt_ids)
    assert glue == f"<|im_start|>user\n{RETRY_PROMPT}<|im_end|>\n<|im_start|>assistant\n"
    for bad in ({"max_turns": 0, "turn_discount": 0.5}, {"max_turns": 2, "turn_discount": 0.0}, {"turn_discount": 2}):
        with pytest.raises(ValueError):
            make(always_zero, **{"max_turns": 2, **bad})


def test_row_layout_glue_masks_and_discount(tok, make):
    """Three answers: cut by length (EOS added), ended by EOS (none added), then a success worth 0.9 ** 2."""
    from areal_lite.utils.hf_utils import chat_prompt_ids
    from areal_lite.utils.trajectory import check_trajectory

    eos = tok.eos_token_id
    a1, a2, a3 = text_ids(tok, "It is 6"), text_ids(tok, "7.") + [eos], text_ids(tok, "5.") + [eos]
    policy = ScriptedPolicy([a1, a2, a3])
    wf = make(retries_to_third, max_turns=4, turn_discount=0.9)
    row = asyncio.run(wf.arun_episode(policy, {"messages": QUESTION}))
    check_trajectory(row)
    prompt, glue = chat_prompt_ids(tok, QUESTION), wf.multi_turn_prompt_ids
    parts = [(prompt, 0), (a1, 1), ([eos] + glue, 0), (a2, 1), (glue, 0), (a3, 1)]
    assert row["input_ids"][0].tolist() == [t for ids, _ in parts for t in ids]
    assert row["loss_mask"][0].tolist() == [m for ids, m in parts for _ in ids]
    assert row["versions"][0].tolist() == [3 if m else -1 for ids, m in parts for _ in ids]
    assert row["logprobs"][0].tolist() == [-0.5 if m else 0.0 for ids, m in parts for _ in ids]
    length = sum(len(ids) for ids, _ in parts)
    assert {k: tuple(v.shape) for k, v in row.items()} == {
        **{k: (1, length) for k in ("input_ids", "attention_mask", "loss_mask", "logprobs", "versions")},
        "rewards": (1,),
    }
    assert row["rewards"].item() == pytest.approx(0.81)
    # Each request was the whole trajectory so far, with a fresh rid and one sample.
    assert [r.input_ids for r in policy.requests] == [[t for ids, _ in parts[:k] for t in ids] for k in (1, 3, 5)]
    assert len({r.rid for r in policy.requests}) == 3 and all(r.gconfig.n_samples == 1 for r in policy.requests)


def test_empty_output_gets_no_eos_and_negative_reward_stops(tok, make):
    from areal_lite.utils.hf_utils import chat_prompt_ids

    policy = ScriptedPolicy([[], text_ids(tok, "5")])
    wf = make(always_zero, max_turns=2, turn_discount=0.5)
    row = asyncio.run(wf.arun_episode(policy, {"messages": QUESTION}))
    prompt = chat_prompt_ids(tok, QUESTION)
    assert row["input_ids"][0].tolist() == prompt + wf.multi_turn_prompt_ids + text_ids(tok, "5")
    assert row["rewards"].item() == 0.0
    # AReaL retries only on a reward of exactly 0.0: a negative one ends the episode after one answer.
    policy = ScriptedPolicy([text_ids(tok, "6"), text_ids(tok, "5")])
    row = asyncio.run(make(negative, max_turns=3, turn_discount=0.5).arun_episode(policy, {"messages": QUESTION}))
    assert len(policy.requests) == 1 and row["rewards"].item() == -1.0


def test_reward_sees_context_and_completion_without_special_tokens(tok, make):
    policy = ScriptedPolicy([text_ids(tok, "5.") + [tok.eos_token_id]])
    wf = make(clean_text, max_turns=2, turn_discount=0.5)
    row = asyncio.run(wf.arun_episode(policy, {"question": "What is 2 + 3?"}))  # the kit also takes `question`
    assert row["rewards"].item() == 1.0 and len(policy.requests) == 1


def test_failing_reward_does_not_kill_the_rollout(make, engine):
    """A reward that raises scores 0.0 (AReaL re-raises and the rollout dies): every turn runs, on the real engine."""
    import torch

    from areal_lite.utils.trajectory import check_trajectory

    wf = make(crashing, max_turns=3, turn_discount=0.9)
    items = engine.rollout_batch([{"messages": QUESTION}], workflow=wf, group_size=2)
    assert len(items) == 1 and torch.equal(items[0]["rewards"], torch.zeros(2))
    assert wf.async_reward_fn.stats["errors"] == 6  # 2 episodes x 3 turns, each scored 0.0
    check_trajectory(items[0])
    for mask, real in zip(items[0]["loss_mask"], items[0]["attention_mask"]):
        mask = mask[real]
        assert int((mask[1:] - mask[:-1] == 1).sum()) == 3, "three answers, separated by retry requests"
