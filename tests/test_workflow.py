"""Workflows end to end against a real embedded server (tiny model), a real RAG server, and one SmolLM2 run.

Every result goes through `check_trajectory`. The tiny model is random, so most tests use rewards that do not
depend on what it writes: always 1.0, always 0.0, and a file-backed counter that succeeds on the n-th call, all
with AReaL's reward signature. They are module-level because `AsyncRewardWrapper` runs them in worker processes.

A random model never emits `<search>...</search>` on purpose, so the search agent's tool path is driven by
`ScriptedPolicy`, which replays fixed completions through the same `agenerate(ModelRequest) -> ModelResponse`
interface (it stands in for the *model*, not for our engine); the same workflow also runs on the real engine.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time

import pytest
import torch

from areal_lite.api.cli_args import GenerationHyperparameters, InferenceEngineConfig
from areal_lite.api.io_struct import ModelRequest, ModelResponse
from areal_lite.api.reward_api import AsyncRewardWrapper
from areal_lite.api.workflow_api import RolloutWorkflow
from areal_lite.infra.workflow_executor import resolve_workflow
from areal_lite.kit.notebook.viewer import trajectory_segments
from areal_lite.utils.data import concat_padded_tensors
from areal_lite.utils.functional import discounted_returns
from areal_lite.utils.hf_utils import chat_prompt_ids, chat_turn_fragments
from areal_lite.utils.trajectory import TrajectoryError, check_trajectory
from areal_lite.workflow.grouped import GroupedWorkflow
from areal_lite.workflow.multi_turn_feedback import MultiTurnFeedbackWorkflow
from areal_lite.workflow.reflection import REFLECTION_PROMPT, ReflectionWorkflow
from areal_lite.workflow.rlvr import RLVRWorkflow
from areal_lite.workflow.search_agent import PROMPT_TEMPLATE, SearchAgentWorkflow

# ---------------------------------------------------------------------------------------------- reward functions
# Module-level so worker processes can import them. AReaL's signature: (prompt, completions, prompt_ids,
# completion_ids, **data).


def ALWAYS_ONE(prompt, completions, prompt_ids, completion_ids, **data):
    return 1.0


def ALWAYS_ZERO(prompt, completions, prompt_ids, completion_ids, **data):
    return 0.0


def slow_reward(prompt, completions, prompt_ids, completion_ids, **data):
    time.sleep(60)
    return 1.0


def crashing_reward(prompt, completions, prompt_ids, completion_ids, **data):
    raise RuntimeError("reward bug")


def recording_reward(prompt, completions, prompt_ids, completion_ids, answer, log, **data):
    """Writes what it was given to the file `log` (a data field), so a test can check the call."""
    with open(log, "w") as f:
        json.dump(
            {
                "prompt": prompt,
                "completions": completions,
                "prompt_ids": list(prompt_ids),
                "completion_ids": list(completion_ids),
                "answer": answer,
                "other": sorted(data),
            },
            f,
        )
    return 0.5


def nth_call_succeeds(prompt, completions, prompt_ids, completion_ids, answer, **data):
    """`answer` = "path|n": 1.0 on the n-th call (counted in the file at path), else 0.0."""
    path, n = answer.rsplit("|", 1)
    with open(path, "a") as f:
        f.write("x")
    return 1.0 if os.path.getsize(path) == int(n) else 0.0


# ---------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def engine(embedded_server):
    from areal_lite.engine.sglang_remote import RemoteSGLangEngine

    cfg = InferenceEngineConfig(consumer_batch_size=8, max_concurrent_rollouts=8, max_head_offpolicyness=100_000)
    eng = RemoteSGLangEngine(cfg)
    eng.initialize(addr=embedded_server.address)
    yield eng
    eng.destroy()


@pytest.fixture(scope="module")
def rewards():
    """One wrapper (worker pool) per reward function, shared by the tests."""
    ws = {
        "one": AsyncRewardWrapper(ALWAYS_ONE, timeout_seconds=30),
        "zero": AsyncRewardWrapper(ALWAYS_ZERO, timeout_seconds=30),
        "nth": AsyncRewardWrapper(nth_call_succeeds, timeout_seconds=30),
    }
    yield ws
    for w in ws.values():
        w.shutdown()


CORPUS = [
    {"id": "0", "title": "France", "contents": "Paris is the capital of France."},
    {"id": "1", "title": "Japan", "contents": "Tokyo is the capital of Japan."},
    {"id": "2", "title": "Kenya", "contents": "Nairobi is the capital of Kenya."},
    {"id": "3", "title": "Peru", "contents": "Lima is the capital of Peru."},
]


@pytest.fixture(scope="module")
def rag_server(tmp_path_factory):
    from areal_lite.kit.rag import launch_rag_server

    path = tmp_path_factory.mktemp("rag") / "corpus.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in CORPUS))
    handle = launch_rag_server(str(path))
    handle.wait_ready(timeout=120)
    yield handle
    handle.stop()


def _gconfig(**kw):
    kw.setdefault("max_new_tokens", 8)
    return GenerationHyperparameters(**kw)


def _msgs(q="What is 2 + 3?"):
    return [{"role": "user", "content": q}]


def _render(tok, messages, gen=False):
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)


def _outputs(batch, row=0):
    """Token lists of the generated segments of a row, in order."""
    ids = batch["input_ids"][row].tolist()
    return [ids[s.start : s.end] for s in trajectory_segments(batch, row) if s.generated]


def _assert_chat_conversation(tok, batch, row, messages, user_turns):
    """The decoded row equals the chat template of the conversation (prompt, outputs, user turns between)."""
    outs = _outputs(batch, row)
    conv = list(messages)
    for k, out in enumerate(outs):
        content = out[:-1] if out and out[-1] == tok.eos_token_id else out
        conv.append({"role": "assistant", "content": tok.decode(content, skip_special_tokens=False)})
        if k < len(outs) - 1:
            conv.append({"role": "user", "content": user_turns[k]})
    full = _render(tok, conv)
    n = int(batch["attention_mask"][row].sum())
    decoded = tok.decode(batch["input_ids"][row, :n].tolist(), skip_special_tokens=False)
    assert full.startswith(decoded), f"\n{decoded!r}\n!=\n{full!r}"
    # Only the last output's end-of-turn may be missing ("\n" after EOS, or all of it after a length stop).
    assert full[len(decoded) :] in ("\n", "<|im_end|>\n")
    return outs


class ScriptedPolicy:
    """Replays fixed completions as `ModelResponse`s (stands in for a model that calls tools on cue)."""

    def __init__(self, tok, completions):
        self.tok, self.completions, self.requests = tok, list(completions), []

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        self.requests.append(req)
        text = self.completions[min(len(self.requests) - 1, len(self.completions) - 1)]
        ids = self.tok(text, add_special_tokens=False)["input_ids"][: req.gconfig.max_new_tokens]
        return ModelResponse(
            input_tokens=list(req.input_ids),
            output_tokens=ids,
            output_logprobs=[-1.0] * len(ids),
            output_versions=[0] * len(ids),
            stop_reason="stop",
        )


# ---------------------------------------------------------------------------------------------- chat helpers


def test_chat_prompt_ids_ends_with_generation_prompt(tok):
    # A common slip: apply_chat_template(..., tokenize=True) without add_generation_prompt=True, so the model
    # would start by writing the assistant header itself.
    raw = tok.apply_chat_template(_msgs(), tokenize=True, add_generation_prompt=True)
    assert not isinstance(raw, list)  # transformers 5 returns a BatchEncoding: we must normalise it
    ids = chat_prompt_ids(tok, _msgs())
    assert isinstance(ids, list) and all(isinstance(t, int) for t in ids)
    assert tok.decode(ids) == _render(tok, _msgs(), gen=True)
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    wf = RLVRWorkflow(ALWAYS_ONE, _gconfig(), tok)
    assert wf.prompt_ids({"messages": _msgs()}) == ids
    assert wf.prompt_ids({"question": "What is 2 + 3?"}) == ids  # built from data["question"]
    with_sys = RLVRWorkflow(ALWAYS_ONE, _gconfig(), tok, system_prompt="Be brief.").prompt_ids({"messages": _msgs()})
    assert tok.decode(with_sys).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user")


def test_chat_turn_fragments_keep_chatml_exact(tok):
    frag = chat_turn_fragments(tok, REFLECTION_PROMPT)
    assert frag.end_of_turn_text == "<|im_end|>\n"
    assert frag.user_turn_text == f"<|im_start|>user\n{REFLECTION_PROMPT}<|im_end|>\n<|im_start|>assistant\n"
    prompt = chat_prompt_ids(tok, _msgs())
    answer = tok("It is 6.", add_special_tokens=False)["input_ids"]
    expected = _render(
        tok,
        _msgs() + [{"role": "assistant", "content": "It is 6."}, {"role": "user", "content": REFLECTION_PROMPT}],
        gen=True,
    )
    # Stopped on EOS (the output ends with <|im_end|>) and cut by length (no EOS): both give the template's text.
    for out in (answer + [tok.eos_token_id], answer):
        assert tok.decode(prompt + out + frag.after_output(out)) == expected
    # The naive fragment (token diff of [assistant] vs [assistant, user]) starts after "<|im_end|>\n", so
    # output + EOS + fragment loses the newline: the model would be trained on a context it never sees at test time.
    s1 = tok.apply_chat_template([{"role": "assistant", "content": "x"}], tokenize=True)["input_ids"]
    two = [{"role": "assistant", "content": "x"}, {"role": "user", "content": REFLECTION_PROMPT}]
    s2 = tok.apply_chat_template(two, tokenize=True, add_generation_prompt=True)["input_ids"]
    seed_fragment = s2[len(s1) :]
    assert tok.decode(prompt + answer + [tok.eos_token_id] + seed_fragment) != expected


def test_discounted_returns():
    assert discounted_returns([], 0.9) == []
    assert discounted_returns([1.0], 0.9) == [1.0]
    assert discounted_returns([-1.0, -1.0, 1.0], 0.5) == pytest.approx([-1.25, -0.5, 1.0])


def test_turn_reward_formula(tok):
    wf = MultiTurnFeedbackWorkflow(ALWAYS_ONE, _gconfig(), tok, reward_scaling=2.0, reward_bias=0.5)
    assert wf.turn_reward(1.0) == pytest.approx((1.0 - 0.5) * 2.0)
    assert wf.turn_reward(0.0) == pytest.approx((-1.0 - 0.5) * 2.0)


def test_base_class_is_abstract():
    with pytest.raises(TypeError, match="abstract"):
        RolloutWorkflow()


# ---------------------------------------------------------------------------------------------- group size once


def test_group_size_is_given_once(tok):
    inner = RLVRWorkflow(ALWAYS_ONE, _gconfig(n_samples=4), tok)
    g = GroupedWorkflow(inner)
    assert g.group_size == 4 and g.gconfig.n_samples == 4
    assert g.workflow.gconfig.n_samples == 1 and inner.gconfig.n_samples == 4  # the caller's object is untouched
    assert GroupedWorkflow(inner, group_size=4).group_size == 4  # agreeing is fine
    with pytest.raises(ValueError, match="given twice and they disagree"):
        GroupedWorkflow(inner, group_size=3)
    single = RLVRWorkflow(ALWAYS_ONE, _gconfig(n_samples=1), tok)
    assert GroupedWorkflow(single, group_size=3).group_size == 3  # n_samples=1 means "not set"
    with pytest.raises(ValueError, match=">= 1"):
        GroupedWorkflow(single, group_size=0)
    # A plain workflow samples one trajectory per call whatever n_samples says (AReaL's rule: the engine's
    # group_size= makes the group), so a config's gconfig can be passed as it is.
    req = inner.request([1, 2, 3])
    assert req.gconfig.n_samples == 1 and req.tokenizer is tok


# ---------------------------------------------------------------------------------------------- RLVR


def test_rlvr_direct_episode(tok, engine, rewards):
    wf = RLVRWorkflow(rewards["one"], _gconfig(), tok)
    data = {"messages": _msgs(), "answer": "5"}
    out = asyncio.run(wf.arun_episode(engine, data))
    assert "rewards" in out and "reward" not in out  # AReaL's key is `rewards`; `reward` would be ignored
    assert out["rewards"].tolist() == [1.0]
    assert out["input_ids"].shape[0] == 1
    prompt_text = _render(tok, _msgs(), gen=True)
    gen = _outputs(out)[0]
    assert 1 <= len(gen) <= 8
    check_trajectory(out, tok, [[prompt_text, tok.decode(gen, skip_special_tokens=False)]])


def test_rlvr_through_rollout_batch_with_real_reward(tok, engine):
    from areal_lite.reward.gsm8k import gsm8k_reward_fn

    wf = RLVRWorkflow(gsm8k_reward_fn, _gconfig(), tok)
    data = [{"messages": _msgs(f"What is {i} + 1?"), "answer": f"#### {i + 1}"} for i in range(3)]
    batch = concat_padded_tensors(engine.rollout_batch(data, workflow=wf))
    assert batch["input_ids"].shape[0] == 3 and batch["rewards"].shape == (3,)
    assert set(batch["rewards"].tolist()) <= {0.0, 1.0}
    check_trajectory(batch)
    for i in range(3):  # input order is kept
        n = int(batch["attention_mask"][i].sum())
        assert f"What is {i} + 1?" in tok.decode(batch["input_ids"][i, :n].tolist())


def test_reward_timeout_is_used_and_rollout_survives(tok, engine):
    # A reward timeout that is defined but not applied lets one hanging reward block the whole rollout.
    wf = RLVRWorkflow(slow_reward, _gconfig(), tok, reward_timeout=3.0)
    assert wf.async_reward_fn.timeout_seconds == 3.0
    try:
        t0 = time.monotonic()
        out = asyncio.run(wf.arun_episode(engine, {"messages": _msgs(), "answer": "5"}))
        assert time.monotonic() - t0 < 30
        assert out["rewards"].tolist() == [0.0]
        check_trajectory(out)
        assert wf.async_reward_fn.stats["timeouts"] == 1
    finally:
        wf.async_reward_fn.shutdown()


def test_crashing_reward_scores_zero(tok, engine):
    wf = RLVRWorkflow(crashing_reward, _gconfig(), tok)
    try:
        out = asyncio.run(wf.arun_episode(engine, {"question": "What is 1 + 1?", "answer": "2"}))
        assert out["rewards"].tolist() == [0.0]
        check_trajectory(out)
    finally:
        wf.async_reward_fn.shutdown()


def test_reward_gets_areals_arguments(tok, engine, tmp_path):
    """AReaL's reward call: prompt and completion as text and as ids, then every field of the data row."""
    log = tmp_path / "call.json"
    wf = RLVRWorkflow(recording_reward, _gconfig(), tok)
    try:
        out = asyncio.run(wf.arun_episode(engine, {"messages": _msgs(), "answer": "5", "log": str(log), "id": 3}))
    finally:
        wf.async_reward_fn.shutdown()
    assert out["rewards"].tolist() == [0.5]
    got = json.loads(log.read_text())
    n_prompt = len(got["prompt_ids"])
    assert got["prompt_ids"] + got["completion_ids"] == out["input_ids"][0].tolist()
    assert got["prompt"] == tok.decode(got["prompt_ids"]) and got["prompt"] == _render(tok, _msgs(), gen=True)
    assert got["completions"] == tok.decode(got["completion_ids"], skip_special_tokens=True)
    assert out["loss_mask"][0, :n_prompt].sum() == 0 and out["loss_mask"][0, n_prompt:].all()
    assert got["answer"] == "5" and got["other"] == ["id", "messages"]


# ---------------------------------------------------------------------------------------------- grouped


def test_grouped_rlvr_gives_g_contiguous_rows(tok, engine, rewards):
    wf = GroupedWorkflow(RLVRWorkflow(rewards["one"], _gconfig(n_samples=3), tok))
    data = [{"messages": _msgs(f"Question number {i}?"), "answer": "x"} for i in range(2)]
    batch = concat_padded_tensors(engine.rollout_batch(data, workflow=wf))
    assert batch["input_ids"].shape[0] == 6 and batch["rewards"].tolist() == [1.0] * 6
    check_trajectory(batch)
    for r in range(6):
        n = int(batch["attention_mask"][r].sum())
        text = tok.decode(batch["input_ids"][r, :n].tolist())
        assert f"Question number {r // 3}?" in text  # rows 0-2: prompt 0, rows 3-5: prompt 1
    direct = asyncio.run(wf.arun_episode(engine, data[0]))
    assert direct["input_ids"].shape[0] == 3
    check_trajectory(direct)


def test_grouped_rejects_whole_group_when_one_episode_is_rejected(tok, engine, rewards):
    class RejectSome(RolloutWorkflow):
        def __init__(self):
            self.gconfig = _gconfig(n_samples=3)
            self.calls = 0
            self.inner = RLVRWorkflow(rewards["one"], _gconfig(), tok)

        async def arun_episode(self, engine, data):
            self.calls += 1
            return None if self.calls == 2 else await self.inner.arun_episode(engine, data)

    wf = GroupedWorkflow(RejectSome())
    assert asyncio.run(wf.arun_episode(engine, {"messages": _msgs(), "answer": "x"})) is None


def test_grouped_rows_do_not_depend_on_which_episode_got_which_sample(tok):
    """The server answers a group's identical requests in arrival order, so which episode gets which sample varies
    from run to run; with `sort_rows` the group's rows do not (the update sums them in order). Each episode here
    takes the next of three scripted answers, handed out in two different orders; the rows come out the same."""
    answers = [
        {"input_ids": torch.tensor([[5, 6, 9]]), "rewards": torch.tensor([1.0])},
        {"input_ids": torch.tensor([[5, 6, 7, 8]]), "rewards": torch.tensor([0.0])},
        {"input_ids": torch.tensor([[5, 6, 7]]), "rewards": torch.tensor([0.5])},
    ]

    class Scripted(RolloutWorkflow):
        def __init__(self, order):
            self.gconfig, self.order = _gconfig(n_samples=3), list(order)

        async def arun_episode(self, engine, data):
            await asyncio.sleep(0)  # the episodes of the group run at once
            return answers[self.order.pop(0)]

    def group(order, **kw):
        return asyncio.run(GroupedWorkflow(Scripted(order), **kw).arun_episode(None, {}))

    groups = [group(order, sort_rows=True) for order in ([0, 1, 2], [2, 0, 1])]
    for key in ("input_ids", "rewards"):
        assert torch.equal(groups[0][key], groups[1][key])
    assert groups[0]["input_ids"].tolist() == [[5, 6, 7, 0], [5, 6, 7, 8], [5, 6, 9, 0]]  # by content, padded
    assert groups[0]["rewards"].tolist() == [0.5, 0.0, 1.0]  # each row keeps its own fields
    assert group([2, 0, 1])["rewards"].tolist() == [0.5, 1.0, 0.0]  # by default AReaL's order: as started
    # the engine's group_size= sorts, and so does the kit's trainer (build_workflow)
    assert resolve_workflow(Scripted([0, 1, 2]), None, group_size=3).sort_rows
    from areal_lite.api.cli_args import load_expr_config
    from areal_lite.kit.trainer.train import TrainConfig, build_workflow

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    config, _ = load_expr_config(["--config", os.path.join(root, "configs", "arith_grpo_demo.yaml")], TrainConfig)
    assert build_workflow(config, tok).sort_rows


# ---------------------------------------------------------------------------------------------- reflection


def test_reflection_runs_all_turns_when_wrong(tok, engine, rewards):
    wf = ReflectionWorkflow(rewards["zero"], _gconfig(), tok, max_turns=3, turn_discount=0.9)
    out = asyncio.run(wf.arun_episode(engine, {"messages": _msgs(), "answer": "5"}))
    check_trajectory(out)
    assert out["rewards"].tolist() == [0.0]
    outs = _assert_chat_conversation(tok, out, 0, _msgs(), [REFLECTION_PROMPT] * 2)
    assert len(outs) == 3
    # The reflection tokens are exactly the pre-tokenized fragment (never re-tokenized per episode).
    segs = trajectory_segments(out, 0)
    ids = out["input_ids"][0].tolist()
    for s in segs[2:-1:2]:
        assert ids[s.start : s.end][-len(wf.fragments.user_turn) :] == wf.fragments.user_turn


def test_reflection_discounts_late_success(tok, engine, rewards, tmp_path):
    wf = ReflectionWorkflow(rewards["nth"], _gconfig(), tok, max_turns=4, turn_discount=0.9)
    data = {"messages": _msgs(), "answer": f"{tmp_path / 'calls'}|2"}  # correct on the 2nd answer
    out = asyncio.run(wf.arun_episode(engine, data))
    check_trajectory(out)
    assert len(_outputs(out)) == 2
    assert out["rewards"].item() == pytest.approx(0.9)
    first = asyncio.run(ReflectionWorkflow(rewards["one"], _gconfig(), tok).arun_episode(engine, data))
    assert len(_outputs(first)) == 1 and first["rewards"].item() == 1.0


def test_grouped_reflection_through_rollout_batch(tok, engine, rewards):
    wf = GroupedWorkflow(ReflectionWorkflow(rewards["zero"], _gconfig(n_samples=2), tok, max_turns=2))
    batch = concat_padded_tensors(engine.rollout_batch([{"messages": _msgs(), "answer": "5"}] * 2, workflow=wf))
    assert batch["input_ids"].shape[0] == 4
    check_trajectory(batch)
    for r in range(4):
        assert len(_assert_chat_conversation(tok, batch, r, _msgs(), [REFLECTION_PROMPT])) == 2


# ---------------------------------------------------------------------------------------------- multi-turn feedback


def test_multi_turn_feedback_turn_level_returns(tok, engine, rewards, tmp_path):
    from areal_lite.workflow.multi_turn_feedback import FEEDBACK_WRONG

    wf = MultiTurnFeedbackWorkflow(rewards["nth"], _gconfig(), tok, num_turns=4, turn_discount=0.5)
    data = {"messages": _msgs(), "answer": f"{tmp_path / 'calls'}|3"}  # wrong, wrong, correct -> stop
    out = asyncio.run(wf.arun_episode(engine, data))
    check_trajectory(out)
    outs = _assert_chat_conversation(tok, out, 0, _msgs(), [FEEDBACK_WRONG] * 2)
    assert len(outs) == 3
    # r = [-1, -1, +1]; G_2 = 1, G_1 = -1 + 0.5 = -0.5, G_0 = -1 - 0.25 = -1.25
    assert out["rewards"].item() == pytest.approx(-1.25)
    tr, lm = out["token_returns"][0], out["loss_mask"][0]
    assert tr.dtype == torch.float32 and tr.shape == out["input_ids"][0].shape
    got = [tr[s.start : s.end].unique().tolist() for s in trajectory_segments(out, 0) if s.generated]
    assert got == [[-1.25], [-0.5], [1.0]]
    assert (tr[lm == 0] == 0).all()


def test_multi_turn_feedback_trains_on_the_returns_fn_it_is_given(tok, engine, rewards, tmp_path):
    """Notebook 06 passes the learner's returns: whatever they compute is what the tokens carry (here: undiscounted)."""
    seen = []

    def undiscounted(turn_rewards, gamma):
        seen.append((list(turn_rewards), gamma))
        return [sum(turn_rewards[k:]) for k in range(len(turn_rewards))]

    wf = MultiTurnFeedbackWorkflow(
        rewards["nth"], _gconfig(), tok, num_turns=4, turn_discount=0.5, returns_fn=undiscounted
    )
    out = asyncio.run(wf.arun_episode(engine, {"messages": _msgs(), "answer": f"{tmp_path / 'calls'}|3"}))
    assert seen == [([-1.0, -1.0, 1.0], 0.5)]
    got = [
        out["token_returns"][0][s.start : s.end].unique().tolist() for s in trajectory_segments(out, 0) if s.generated
    ]
    assert got == [[-1.0], [0.0], [1.0]] and out["rewards"].item() == -1.0


def test_multi_turn_feedback_seed_mode_runs_all_turns(tok, engine, rewards):
    from areal_lite.workflow.multi_turn_feedback import FEEDBACK_CORRECT

    wf = MultiTurnFeedbackWorkflow(
        rewards["one"], _gconfig(), tok, num_turns=2, turn_discount=0.9, stop_on_correct=False
    )
    out = asyncio.run(wf.arun_episode(engine, {"messages": _msgs(), "answer": "5"}))
    check_trajectory(out)
    _assert_chat_conversation(tok, out, 0, _msgs(), [FEEDBACK_CORRECT])
    assert out["rewards"].item() == pytest.approx(1.0 + 0.9)
    early = MultiTurnFeedbackWorkflow(rewards["one"], _gconfig(), tok, num_turns=2)
    out = asyncio.run(early.arun_episode(engine, {"messages": _msgs(), "answer": "5"}))
    assert len(_outputs(out)) == 1 and out["rewards"].item() == 1.0


def test_grouped_multi_turn_through_rollout_batch(tok, engine, rewards):
    wf = GroupedWorkflow(MultiTurnFeedbackWorkflow(rewards["zero"], _gconfig(n_samples=2), tok, num_turns=2))
    batch = concat_padded_tensors(engine.rollout_batch([{"messages": _msgs(), "answer": "5"}] * 2, workflow=wf))
    assert batch["token_returns"].shape == batch["input_ids"].shape and batch["input_ids"].shape[0] == 4
    check_trajectory(batch)
    assert batch["rewards"].tolist() == pytest.approx([-1.0 - 1.0 * 0.9] * 4)


# ---------------------------------------------------------------------------------------------- search agent


def test_search_agent_tool_path_with_real_rag(tok, rag_server):
    policy = ScriptedPolicy(
        tok,
        [
            " I should look it up.</think>\n<search> capital of France </search>",
            "\n<think>The passage says Paris.</think>\n<answer> Paris </answer>",
        ],
    )
    wf = SearchAgentWorkflow(tok, _gconfig(max_new_tokens=64), rag_addr=rag_server.address, topk=2)
    data = {"question": "What is the capital of France?", "answer": ["Paris", "Paris, France"]}
    out = asyncio.run(wf.arun_episode(policy, data))
    assert out["rewards"].tolist() == [1.0]
    assert (out["searches"].tolist(), out["search_errors"].tolist()) == ([1.0], [0.0])
    # Every request continues exactly the trajectory so far (no output appended twice).
    r0, r1 = policy.requests
    outs = _outputs(out)
    obs = [s for s in trajectory_segments(out, 0) if s.kind == "observation"][0]
    obs_ids = out["input_ids"][0, obs.start : obs.end].tolist()
    assert r1.input_ids == r0.input_ids + outs[0] + obs_ids
    assert out["input_ids"][0].tolist() == r1.input_ids + outs[1]
    assert "</search>" in r0.gconfig.stop and "</answer>" in r0.gconfig.stop and r0.gconfig.n_samples == 1
    info = tok.decode(obs_ids)
    assert info.startswith("\n\n<information>") and "Paris is the capital of France." in info
    check_trajectory(
        out,
        tok,
        [
            [
                PROMPT_TEMPLATE.format(question=data["question"]),
                " I should look it up.</think>\n<search> capital of France </search>",
                info,
                "\n<think>The passage says Paris.</think>\n<answer> Paris </answer>",
            ]
        ],
    )


def test_search_agent_rag_down_gives_error_observation(tok):
    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    policy = ScriptedPolicy(tok, ["<search> capital of Peru </search>", "<answer> Lima </answer>"])
    wf = SearchAgentWorkflow(tok, _gconfig(max_new_tokens=32), rag_addr=dead, search_timeout=5)
    out = asyncio.run(wf.arun_episode(policy, {"question": "Capital of Peru?", "answer": ["Lima"]}))
    check_trajectory(out)
    obs = [s for s in trajectory_segments(out, 0) if s.kind == "observation"][0]
    text = tok.decode(out["input_ids"][0, obs.start : obs.end].tolist())
    assert "<information>\nsearch failed: cannot connect" in text and text.endswith("</information>")
    assert out["rewards"].tolist() == [1.0]  # the episode went on and answered
    assert (out["searches"].tolist(), out["search_errors"].tolist()) == ([1.0], [1.0])  # counted on the row


def test_search_agent_any_tool_failure_is_an_observation(tok, monkeypatch):
    """Not only SearchToolError: whatever the search raises, the model reads why and the episode goes on."""
    import areal_lite.workflow.search_agent as search_agent

    async def broken(*args, **kwargs):
        raise RuntimeError("index corrupted")

    monkeypatch.setattr(search_agent, "call_search_tool", broken)
    policy = ScriptedPolicy(tok, ["<search> capital of Peru </search>", "<answer> Lima </answer>"])
    wf = SearchAgentWorkflow(tok, _gconfig(max_new_tokens=32), rag_addr="127.0.0.1:1", search_timeout=5)
    out = asyncio.run(wf.arun_episode(policy, {"question": "Capital of Peru?", "answer": ["Lima"]}))
    check_trajectory(out)
    assert "search failed: RuntimeError: index corrupted" in tok.decode(out["input_ids"][0].tolist())
    assert out["rewards"].tolist() == [1.0] and out["search_errors"].tolist() == [1.0]


def test_search_agent_slow_rag_times_out_into_observation(tok):
    with socket.socket() as server:  # accepts connections (backlog) but never answers
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        addr = f"127.0.0.1:{server.getsockname()[1]}"
        policy = ScriptedPolicy(tok, ["<search> x </search>", "<answer> y </answer>"])
        wf = SearchAgentWorkflow(tok, _gconfig(max_new_tokens=32), rag_addr=addr, search_timeout=0.5)
        t0 = time.monotonic()
        out = asyncio.run(wf.arun_episode(policy, {"question": "q?", "answer": ["z"]}))
        assert time.monotonic() - t0 < 10
    check_trajectory(out)
    assert "search failed:" in tok.decode(out["input_ids"][0].tolist()) and "did not answer" in tok.decode(
        out["input_ids"][0].tolist()
    )
    assert out["rewards"].tolist() == [0.0]


def test_search_agent_respects_max_tokens_and_max_turns(tok, rag_server):
    policy = ScriptedPolicy(tok, ["<search> capital of Japan </search>"])  # searches forever
    wf = SearchAgentWorkflow(
        tok, _gconfig(max_new_tokens=32), rag_addr=rag_server.address, max_turns=50, max_tokens=400
    )
    out = asyncio.run(wf.arun_episode(policy, {"question": "q?", "answer": ["Tokyo"]}))
    check_trajectory(out)
    assert out["input_ids"].shape[1] <= 400 and out["rewards"].tolist() == [0.0]
    assert all(r.gconfig.max_new_tokens <= 32 for r in policy.requests)
    policy = ScriptedPolicy(tok, ["<search> capital of Japan </search>"])
    wf = SearchAgentWorkflow(tok, _gconfig(max_new_tokens=32), rag_addr=rag_server.address, max_turns=3)
    out = asyncio.run(wf.arun_episode(policy, {"question": "q?", "answer": ["Tokyo"]}))
    assert len(policy.requests) == 3 and len(_outputs(out)) == 3


def test_search_agent_tag_split_across_generations(tok, rag_server):
    policy = ScriptedPolicy(tok, ["<search> capital of", " Kenya </search>", "<answer> Nairobi </answer>"])
    wf = SearchAgentWorkflow(tok, _gconfig(max_new_tokens=32), rag_addr=rag_server.address)
    out = asyncio.run(wf.arun_episode(policy, {"question": "q?", "answer": ["Nairobi"]}))
    check_trajectory(out)
    assert "Nairobi is the capital of Kenya." in tok.decode(out["input_ids"][0].tolist())
    assert out["rewards"].tolist() == [1.0] and len(policy.requests) == 3


def test_search_agent_reward_modes(tok):
    # "set" (token sets) vs "multiset" (SQuAD): a repeated word scores differently.
    data = {"question": "q?", "answer": ["new york"]}
    got = {}
    for mode in ("set", "multiset"):
        policy = ScriptedPolicy(tok, ["<answer> new new york </answer>"])
        wf = SearchAgentWorkflow(tok, _gconfig(max_new_tokens=32), reward_mode=mode)
        got[mode] = asyncio.run(wf.arun_episode(policy, data))["rewards"].item()
    assert got["set"] == pytest.approx(1.0) and got["multiset"] == pytest.approx(0.8)
    with pytest.raises(ValueError, match="reward_mode"):
        SearchAgentWorkflow(tok, _gconfig(), reward_mode="bag")


def test_search_agent_on_real_engine(tok, engine, rag_server):
    inner = SearchAgentWorkflow(
        tok, _gconfig(n_samples=2, max_new_tokens=16), rag_addr=rag_server.address, max_turns=3, max_tokens=400
    )
    wf = GroupedWorkflow(inner)
    data = [
        {"question": "What is the capital of Japan?", "answer": ["Tokyo"]},
        {"question": "What is the capital of Kenya?", "answer": ["Nairobi"]},
    ]
    batch = concat_padded_tensors(engine.rollout_batch(data, workflow=wf))
    assert batch["input_ids"].shape[0] == 4 and batch["input_ids"].shape[1] <= 400
    check_trajectory(batch)
    for r in range(4):
        n = int(batch["attention_mask"][r].sum())
        assert tok.decode(batch["input_ids"][r, :n].tolist()).startswith(
            PROMPT_TEMPLATE.format(question=data[r // 2]["question"])
        )
    direct = asyncio.run(
        inner.__class__(tok, _gconfig(max_new_tokens=16), rag_addr=rag_server.address, max_turns=2).arun_episode(
            engine, data[0]
        )
    )
    check_trajectory(direct)


def test_double_append_would_be_caught(tok, engine):
    # The seed-000 bug, reproduced by hand on a real response: check_trajectory rejects it.
    prompt = tok(PROMPT_TEMPLATE.format(question="q?"), add_special_tokens=False)["input_ids"]
    resp = asyncio.run(engine.agenerate(ModelRequest(input_ids=prompt, gconfig=_gconfig())))
    input_ids = prompt + resp.output_tokens + resp.output_tokens
    loss_mask = [0] * len(prompt) + [1] * resp.output_len
    bad = {
        "input_ids": torch.tensor([input_ids]),
        "attention_mask": torch.ones(1, len(input_ids), dtype=torch.bool),
        "loss_mask": torch.tensor([loss_mask]),
        "logprobs": torch.tensor([[0.0] * len(prompt) + resp.output_logprobs]),
        "versions": torch.tensor([[-1] * len(prompt) + resp.output_versions]),
        "rewards": torch.tensor([0.0]),
    }
    with pytest.raises(TrajectoryError, match="'loss_mask' has shape"):
        check_trajectory(bad)


# ---------------------------------------------------------------------------------------------- SmolLM2


def test_reflection_on_smollm_closes_turns_exactly(smollm_server, smollm_path, rewards):
    """A real chat model stops on <|im_end|>: the next turn must add only "\\n", matching the chat template."""
    from transformers import AutoTokenizer

    from areal_lite.engine.sglang_remote import RemoteSGLangEngine

    tok = AutoTokenizer.from_pretrained(smollm_path)
    eng = RemoteSGLangEngine(InferenceEngineConfig(consumer_batch_size=2, max_head_offpolicyness=100))
    eng.initialize(addr=smollm_server.address)
    try:
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        wf = ReflectionWorkflow(
            rewards["zero"], GenerationHyperparameters(max_new_tokens=32, greedy=True), tok, max_turns=2
        )
        batch = concat_padded_tensors(eng.rollout_batch([{"messages": messages, "answer": "x"}], workflow=wf))
    finally:
        eng.destroy()
    check_trajectory(batch)
    outs = _assert_chat_conversation(tok, batch, 0, messages, [REFLECTION_PROMPT])
    # Greedy SmolLM2 answers this in one short sentence ending with <|im_end|>, so the EOS path was exercised.
    assert outs[0][-1] == tok.eos_token_id, tok.decode(outs[0])
    n = int(batch["attention_mask"][0].sum())
    assert "<|im_end|>\n<|im_start|>user\n" in tok.decode(batch["input_ids"][0, :n].tolist())


# ---------------------------------------------------------------------------------------------- multi-turn feedback:
# turn counts and the per-version answer log


class VersionedPolicy(ScriptedPolicy):
    """ScriptedPolicy whose answers carry the policy version `self.version` (the test bumps it between batches)."""

    version = 0

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        resp = await super().agenerate(req)
        resp.output_versions = [self.version] * len(resp.output_tokens)
        await asyncio.sleep(0)  # let concurrent episodes interleave
        return resp

    def get_version(self) -> int:
        return self.version


def test_multi_turn_feedback_records_turns_to_success(tok, engine, rewards, tmp_path):
    policy = ScriptedPolicy(tok, ["5"])
    cases = [  # (workflow, answer) -> turns to success, solved
        (MultiTurnFeedbackWorkflow(rewards["nth"], _gconfig(), tok, num_turns=4), f"{tmp_path / 'calls'}|2", 2, 1),
        (MultiTurnFeedbackWorkflow(rewards["zero"], _gconfig(), tok, num_turns=3), "5", 3, 0),
        # Running every turn still counts the turns up to the first success.
        (MultiTurnFeedbackWorkflow(rewards["one"], _gconfig(), tok, num_turns=2, stop_on_correct=False), "5", 1, 1),
    ]
    for wf, answer, turns, solved in cases:
        out = asyncio.run(wf.arun_episode(policy, {"messages": _msgs(), "answer": answer}))
        check_trajectory(out)
        assert out["turns"].tolist() == [float(turns)] and out["solved"].tolist() == [float(solved)]
    grouped = GroupedWorkflow(MultiTurnFeedbackWorkflow(rewards["zero"], _gconfig(n_samples=2), tok, num_turns=2))
    batch = concat_padded_tensors(engine.rollout_batch([{"messages": _msgs(), "answer": "5"}] * 2, workflow=grouped))
    check_trajectory(batch)
    assert batch["turns"].tolist() == [2.0] * 4 and batch["solved"].tolist() == [0.0] * 4


def test_multi_turn_feedback_dumps_answers_per_version(tok, rewards, tmp_path):
    text = "The answer is 5."
    policy = VersionedPolicy(tok, [text])
    log = tmp_path / "log"
    wf = MultiTurnFeedbackWorkflow(rewards["zero"], _gconfig(), tok, num_turns=2, turn_discount=0.5, dump_dir=log)

    async def run(questions):
        return await asyncio.gather(*[wf.arun_episode(policy, {"question": q, "answer": "5"}) for q in questions])

    asyncio.run(run([f"q{i}" for i in range(6)]))  # six concurrent episodes append to the same file
    policy.version = 1
    asyncio.run(run(["late"]))
    assert sorted(os.listdir(log)) == ["v0.jsonl", "v1.jsonl"]
    v0 = [json.loads(line) for line in (log / "v0.jsonl").read_text().splitlines()]
    assert len(v0) == 12 and {r["question"] for r in v0} == {f"q{i}" for i in range(6)}
    answer = tok.decode(tok(text, add_special_tokens=False)["input_ids"][:8], skip_special_tokens=True)
    for episode in {r["episode"] for r in v0}:
        lines = sorted((r for r in v0 if r["episode"] == episode), key=lambda r: r["turn"])
        assert [r["turn"] for r in lines] == [1, 2] and {r["version"] for r in lines} == {0}
        assert [(r["success"], r["reward"], r["ret"]) for r in lines] == [(0.0, -1.0, -1.5), (0.0, -1.0, -1.0)]
        assert all(r["answer"] == answer and r["gold"] == "5" for r in lines)
    v1 = [json.loads(line) for line in (log / "v1.jsonl").read_text().splitlines()]
    assert [(r["question"], r["version"], r["turn"]) for r in v1] == [("late", 1, 1), ("late", 1, 2)]
    blocked = tmp_path / "a_file"  # a log that cannot be written costs the log line, not the episode
    blocked.write_text("")
    wf.dump_dir = str(blocked / "log")
    assert asyncio.run(run(["again"]))[0]["turns"].tolist() == [2.0]
