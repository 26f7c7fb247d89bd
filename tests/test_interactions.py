"""The interaction cache (`experimental.openai.cache`) and the agent workflow (`...openai.proxy.workflow`).

The cache is checked on hand-built interactions (rewards, discount, tree, rows) and, where AReaL 1.0.4 is installed,
against AReaL's own `InteractionCache`. The workflow runs real agents written with the official `openai` SDK
against a real `ChatServer`; the engine behind it is a scripted stand-in (`agenerate` answering fixed text), so
failures, rewards and grouping are tested in seconds. tests/test_chat.py runs the same workflow on the real
embedded server.
"""

from __future__ import annotations

import asyncio

import pytest

from areal_lite import GenerationHyperparameters, ModelResponse, check_trajectory
from areal_lite.experimental.openai.cache import Interaction, InteractionCache, interactions_to_batch
from areal_lite.experimental.openai.proxy.workflow import OpenAIAgentWorkflow
from areal_lite.workflow.grouped import GroupedWorkflow

# ------------------------------------------------------------------------------------------------ hand-built cache


def _resp(prompt, out, version=0):
    return ModelResponse(
        input_tokens=list(prompt),
        output_tokens=list(out),
        output_logprobs=[-0.1 * (i + 1) for i in range(len(out))],
        output_versions=[version] * len(out),
    )


def _it(key, prompt, out, parent=None, n_msgs=1, version=0):
    msgs = [{"role": "user", "content": f"m{i}"} for i in range(n_msgs)]
    answer = [{"role": "assistant", "content": f"answer {key}"}]
    return Interaction(key, msgs, answer, _resp(prompt, out, version), parent=parent, completion_id=key)


@pytest.fixture
def tree():
    """a -> b (a linear follow-up) and a -> c (a branch), each child's prompt extending its parent's ids."""
    cache = InteractionCache()
    a = _it("a", [1, 2, 3], [10, 11], version=0)
    b = _it("b", [1, 2, 3, 10, 11, 4, 5], [12], parent=a, n_msgs=3, version=1)
    c = _it("c", [1, 2, 3, 10, 11, 6], [13, 14], parent=a, n_msgs=3, version=1)
    for it in (a, b, c):
        cache.add(it)
    return cache


def test_rewards_and_discount_follow_areal(tree):
    tree.set_reward("a", 0.5)
    tree.set_last_reward(1.0)  # c, the last one inserted
    assert tree.last_interaction_id == "c" and tree.total_reward == 1.5
    out = tree.apply_reward_discount(turn_discount=0.5)
    # walking back in insertion order: c = 1.0, b = 0 + 0.5 * 1.0, a = 0.5 + 0.5 * 0.5
    assert {k: v.reward for k, v in out.items()} == {"a": 0.75, "b": 0.5, "c": 1.0}
    with pytest.raises(RuntimeError, match="only be called once"):
        tree.apply_reward_discount(0.5)
    with pytest.raises(KeyError, match="no interaction 'zz'"):
        tree.set_reward("zz", 1.0)
    with pytest.raises(ValueError, match="finite"):
        tree.set_reward("a", float("nan"))


def test_discount_equals_areal_own_cache(import_areal):
    areal_cache = import_areal("areal.experimental.openai.cache")
    from areal.experimental.openai.types import InteractionWithTokenLogpReward

    theirs, ours = areal_cache.InteractionCache(), InteractionCache()
    for k in range(4):
        msgs = [{"role": "user", "content": str(j)} for j in range(k + 1)]
        it = InteractionWithTokenLogpReward(messages=msgs, output_message_list=[{"role": "assistant", "content": "x"}])
        it.interaction_id = f"id{k}"
        theirs[f"id{k}"] = it
        ours.add(_it(f"id{k}", [1], [2]))
    for cache in (theirs, ours):
        cache.set_reward("id1", -1.0)
        cache.set_last_reward(2.0)
        cache.apply_reward_discount(turn_discount=0.9)
    assert [v.reward for v in ours.values()] == pytest.approx([v.reward for v in theirs.values()])


def test_export_styles(tree):
    assert list(tree.export_interactions("concat")) == ["b", "c"]  # the leaves
    assert list(tree.export_interactions("individual")) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="style"):
        tree.export_interactions("tree")
    out = tree.export_interactions("concat", reward_discount=1.0)  # AReaL's shortcut: discount, then export
    assert all(v.reward == 0.0 for v in out.values())


def test_concat_rows_train_on_every_generated_token_of_the_path(tree):
    tree.set_reward("a", 1.0)
    tree.set_reward("b", 2.0)
    row = tree["b"].to_tensor_dict("concat", per_turn_returns=True)
    assert row["input_ids"].tolist() == [[1, 2, 3, 10, 11, 4, 5, 12]]
    assert row["loss_mask"].tolist() == [[0, 0, 0, 1, 1, 0, 0, 1]]
    assert row["versions"].tolist() == [[-1, -1, -1, 0, 0, -1, -1, 1]]
    assert row["logprobs"][0].tolist() == pytest.approx([0, 0, 0, -0.1, -0.2, 0, 0, -0.1])
    assert row["token_returns"].tolist() == [[0, 0, 0, 1.0, 1.0, 0, 0, 2.0]]
    assert row["rewards"].tolist() == [2.0]
    check_trajectory(row)
    alone = tree["b"].to_tensor_dict("individual")
    assert alone["loss_mask"].tolist() == [[0, 0, 0, 0, 0, 0, 0, 1]]  # its own output only
    batch = interactions_to_batch(tree.export_interactions("concat"), "concat")
    assert batch["input_ids"].shape == (2, 8) and check_trajectory(batch)
    assert interactions_to_batch({}) == {}


def test_a_prompt_that_does_not_extend_its_parent_is_refused():
    a = _it("a", [1, 2], [3])
    b = _it("b", [1, 9, 3, 4], [5], parent=a)
    with pytest.raises(ValueError, match="does not extend its parent"):
        b.to_tensor_dict()


def test_find_parent_accepts_what_an_agent_sends_back():
    cache = InteractionCache()
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    msgs = [{"role": "user", "content": "q"}]
    it = Interaction("a", msgs, [{"role": "assistant", "content": "ok ", "tool_calls": [call]}], _resp([1], [2]))
    cache.add(it)
    # as `choice.message.model_dump()` gives it back: extra None fields, another call id, reformatted arguments
    sent = {"role": "assistant", "content": "ok", "refusal": None, "audio": None, "function_call": None,
            "tool_calls": [{**call, "id": "other", "function": {"name": "add", "arguments": '{ "a":1 }'}}]}  # fmt: skip
    follow = {"role": "tool", "tool_call_id": "other", "content": "1"}
    assert cache.find_parent(msgs + [sent, follow]) is it
    assert cache.find_parent(msgs + [sent]) is None  # nothing new after the answer
    assert cache.find_parent(msgs + [{**sent, "content": "edited"}, follow]) is None
    assert cache.find_parent(msgs + [sent, follow], tools=[{"type": "function"}]) is None  # other tools


def test_n_choices_share_a_completion_id():
    cache = InteractionCache()
    for i in range(3):
        cache.add(Interaction(f"cmpl-{i}", [], [{"role": "assistant"}], _resp([1], [2]), completion_id="cmpl"))
    cache.set_reward("cmpl", 0.5)
    assert [v.reward for v in cache.values()] == [0.5, 0.5, 0.5]


# ------------------------------------------------------------------------------------------------ the workflow


class ScriptedEngine:
    """`agenerate` answering scripted text: `reply(prompt_text)` -> the completion text (ends with <|im_end|>)."""

    def __init__(self, tok, reply, version=2):
        self.tok, self.reply, self.version, self.calls = tok, reply, version, 0

    async def agenerate(self, req):
        self.calls += 1
        text = self.reply(self.tok.decode(req.input_ids))
        out = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.convert_tokens_to_ids("<|im_end|>")]
        resp = _resp(req.input_ids, out, self.version)
        resp.tokenizer = req.tokenizer
        return resp


@pytest.fixture(scope="module")
def tok(smollm_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_path)


class Agent:
    """Talks `turns` times with the official SDK; returns `reward(completion ids)` or raises after `fail_after`."""

    def __init__(self, turns=2, reward=lambda ids: 1.0, fail_after=None, sleep=0.0):
        self.turns, self.reward, self.fail_after, self.sleep = turns, reward, fail_after, sleep

    async def run(self, data, base_url, api_key, http_client):
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client, max_retries=0)
        msgs, ids = [{"role": "user", "content": data["question"]}], []
        for k in range(self.turns):
            if k == self.fail_after:
                raise RuntimeError("the agent's tool crashed")
            reply = await client.chat.completions.create(model="any", messages=msgs)
            ids.append(reply.id)
            msgs += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "More?"}]
        await asyncio.sleep(self.sleep)
        return self.reward(ids)


def _run(wf, engine, data=None):
    return asyncio.run(wf.arun_episode(engine, data or {"question": "What is 2+2?"}))


@pytest.fixture(scope="module")
def engine(tok):
    return ScriptedEngine(tok, lambda prompt: f"Answer number {prompt.count('<|im_start|>assistant')}.")


def _workflow(agent, tok, **kw):
    return OpenAIAgentWorkflow(agent, tok, GenerationHyperparameters(max_new_tokens=16), **kw)


def test_two_turns_make_one_concat_row(engine, tok):
    wf = _workflow(Agent(turns=2), tok)
    try:
        batch = _run(wf, engine)
        check_trajectory(batch)
        ids, lm = batch["input_ids"][0].tolist(), batch["loss_mask"][0].tolist()
        generated = tok.decode([t for t, m in zip(ids, lm) if m])
        assert generated == "Answer number 1.<|im_end|>Answer number 2.<|im_end|>"
        assert batch["rewards"].tolist() == [1.0] and set(
            batch["versions"][0][batch["loss_mask"][0] == 1].tolist()
        ) == {2}
        assert wf.stats["trained"] == 1
    finally:
        wf.close()


def test_individual_rows_carry_discounted_rewards(engine, tok):
    wf = _workflow(
        Agent(turns=3, reward=lambda ids: {ids[-1]: 1.0, ids[0]: 0.5}),
        tok,
        export_style="individual",
        turn_discount=0.5,
    )
    try:
        batch = _run(wf, engine)
        assert batch["rewards"].tolist() == [0.5 + 0.25, 0.5, 1.0] and check_trajectory(batch)
        assert batch["loss_mask"].sum(dim=1).tolist() == [len(tok("Answer number 1.")["input_ids"]) + 1] * 3
    finally:
        wf.close()


def test_per_turn_returns(engine, tok):
    wf = _workflow(Agent(turns=2, reward=lambda ids: {ids[0]: -1.0, ids[1]: 1.0}), tok, per_turn_returns=True)
    try:
        batch = _run(wf, engine)
        values = batch["token_returns"][0][batch["loss_mask"][0] == 1].tolist()
        n = len(values) // 2
        assert values == [0.0] * n + [1.0] * n  # turn 0: -1 + 1.0 * 1; turn 1: 1
    finally:
        wf.close()


@pytest.mark.parametrize(
    "agent, on_error, trained, stat",
    [
        (Agent(turns=2, fail_after=1), "zero", True, "agent_errors"),  # crashed after one completion: reward 0
        (Agent(turns=2, fail_after=0), "zero", False, "agent_errors"),  # nothing to train on
        (Agent(turns=2, fail_after=1), "reject", False, "agent_errors"),
        (Agent(turns=1, reward=lambda ids: "good"), "zero", True, "reward_errors"),
        (Agent(turns=1, reward=lambda ids: {"chatcmpl-unknown": 1.0}), "zero", True, "reward_errors"),
        (Agent(turns=1, reward=lambda ids: float("inf")), "zero", True, "reward_errors"),
        (Agent(turns=1, reward=lambda ids: 10**400), "zero", True, "reward_errors"),  # float() overflows
        (Agent(turns=1, reward=lambda ids: {ids[0]: 10**400}), "zero", True, "reward_errors"),
        (Agent(turns=1, sleep=600.0), "zero", True, "agent_errors"),  # hangs after its turn: past the timeout
        (Agent(turns=0), "zero", False, "rejected_empty"),
    ],
)
def test_failures_never_kill_the_rollout(engine, tok, agent, on_error, trained, stat, caplog):
    # The hanging agent's one completion must come back inside the timeout (it is trained on); a 1 s timeout against
    # a 3 s sleep raced that completion on a loaded machine. Now the sleep outlasts any timeout (it is cancelled),
    # and 5 s leaves the completion, milliseconds unloaded, ample room.
    wf = _workflow(agent, tok, on_error=on_error, timeout=5.0 if agent.sleep else None)
    try:
        batch = _run(wf, engine)
        assert wf.stats[stat] == 1
        if trained:
            assert batch["rewards"].tolist() == [0.0] and check_trajectory(batch)
        else:
            assert batch is None
    finally:
        wf.close()


def test_on_error_raise(engine, tok):
    wf = _workflow(Agent(turns=1, fail_after=0), tok, on_error="raise")
    try:
        with pytest.raises(RuntimeError, match="tool crashed"):
            _run(wf, engine)
    finally:
        wf.close()


def test_grouped_episodes_share_one_server_and_never_mix(engine, tok):
    wf = _workflow(Agent(turns=2), tok)
    try:
        grouped = GroupedWorkflow(wf, group_size=3)
        batch = _run(grouped, engine)
        assert batch["input_ids"].shape[0] == 3 and check_trajectory(batch)
        assert len(wf._shared["servers"]) == 1 and wf.stats["trained"] == 3
        # every row is one conversation of two turns (sessions kept the episodes apart)
        assert all(tok.decode(r).count("Answer number 2.") == 1 for r in batch["input_ids"].tolist())
    finally:
        wf.close()
    assert wf._shared["servers"] == []


def test_constructor_checks():
    class Sync:
        def run(self, data):
            return 1.0

    with pytest.raises(TypeError, match="async def run"):
        OpenAIAgentWorkflow(Sync(), None)
    with pytest.raises(ValueError, match="export_style"):
        OpenAIAgentWorkflow(Agent(), None, export_style="tree")
    with pytest.raises(ValueError, match="on_error"):
        OpenAIAgentWorkflow(Agent(), None, on_error="ignore")
