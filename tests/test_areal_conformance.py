"""Both directions at run time, against the embedded server: kit workflows under AReaL 1.0.4's own
`RemoteSGLangEngine`, and AReaL's own `RLVRWorkflow` and `MultiTurnWorkflow` under the kit's engine. The kit's
`MultiTurnWorkflow` must also give, under either engine, the batch AReaL's own `MultiTurnWorkflow` gives.

With greedy decoding the same workflow must give the same batch under either engine (same token ids, masks,
versions, rewards; logprobs to float tolerance), with AReaL's dtypes, and pass both sides' checks: the kit's
`check_trajectory` and AReaL's `check_trajectory_format`. Calls use AReaL's signatures (`initialize(addr=...)`,
`rollout_batch(data, workflow, workflow_kwargs, group_size)`, `prepare_batch(dataloader, workflow, ...)`).
The kit's reward workers import this module to unpickle its rewards, so torch (and what imports it) is imported
inside the functions that use it: at the top it would cost every worker of every kit workflow's pool seconds.
"""

from __future__ import annotations

import json

import pytest

from areal_lite.kit.areal.compat import register_with_areal

G = 2  # group size


@pytest.fixture(scope="module")
def areal_engine(embedded_server):
    from areal.api.cli_args import InferenceEngineConfig
    from areal.engine.sglang_remote import RemoteSGLangEngine

    register_with_areal()
    cfg = InferenceEngineConfig(
        experiment_name="conformance",
        trial_name="areal",
        backend="sglang:d1",
        max_concurrent_rollouts=8,
        consumer_batch_size=2,
        # AReaL's rollout_batch obeys the staleness bound: at a fixed version it would block forever after
        # (1 + max_head_offpolicyness) * consumer_batch_size episodes. The kit's does not (see areal_compat).
        max_head_offpolicyness=10_000,
    )
    engine = RemoteSGLangEngine(cfg)
    engine.initialize(addr=embedded_server.address)
    yield engine
    engine.destroy()


@pytest.fixture(scope="module")
def kit_engine(embedded_server):
    from areal_lite import InferenceEngineConfig, RemoteSGLangEngine

    engine = RemoteSGLangEngine(
        InferenceEngineConfig(max_concurrent_rollouts=8, consumer_batch_size=2, max_head_offpolicyness=10_000)
    )
    engine.initialize(addr=embedded_server.address)
    yield engine
    engine.destroy()


@pytest.fixture(scope="module")
def rag_url(tmp_path_factory):
    from areal_lite import launch_rag_server

    path = tmp_path_factory.mktemp("rag") / "corpus.jsonl"
    docs = [
        {"id": str(i), "title": t, "contents": f"{c} is the capital of {t}."}
        for i, (t, c) in enumerate([("France", "Paris"), ("Japan", "Tokyo"), ("Peru", "Lima")])
    ]
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    handle = launch_rag_server(str(path))
    handle.wait_ready(timeout=120)
    yield handle.address
    handle.stop()


def reward_len(prompt, completions, prompt_ids, completion_ids, **data):
    """AReaL's reward signature; deterministic given the tokens. Module level so the worker pool can import it."""
    assert isinstance(prompt, str) and isinstance(completions, str) and "answer" in data
    return float(len(completion_ids) % 3 == 0)


def reward_on_retry(prompt, completions, prompt_ids, completion_ids, **data):
    """0.0 on the first answer, 1.0 once the prompt holds the retry request: every episode takes two turns, so the
    glue between turns and the discount are exercised whatever the random model writes."""
    return float("try to answer it again" in prompt)


ROWS = [
    {
        "messages": [{"role": "user", "content": f"What is {i} + {i}?"}],
        "question": f"What is {i} + {i}?",
        "answer": str(2 * i),
    }
    for i in range(3)
]


def greedy(**kw):
    from areal_lite import GenerationHyperparameters

    return GenerationHyperparameters(greedy=True, max_new_tokens=6, **kw)


def areal_greedy(**kw):
    from areal.api.cli_args import GenerationHyperparameters

    return GenerationHyperparameters(greedy=True, max_new_tokens=6, **kw)


def kit_workflows(tok, rag_url):
    from areal_lite import MultiTurnFeedbackWorkflow, ReflectionWorkflow, RLVRWorkflow, SearchAgentWorkflow
    from areal_lite.workflow.multi_turn import MultiTurnWorkflow

    return {
        "rlvr": RLVRWorkflow(reward_len, greedy(), tok),
        "reflection": ReflectionWorkflow(reward_len, greedy(), tok, max_turns=2, turn_discount=0.9),
        "feedback": MultiTurnFeedbackWorkflow(reward_len, greedy(), tok, num_turns=2, turn_discount=0.5),
        "search": SearchAgentWorkflow(tok, greedy(), rag_addr=rag_url, max_turns=2, max_tokens=256),
        "multi-turn": MultiTurnWorkflow(reward_on_retry, greedy(), tok, max_turns=2, turn_discount=0.9),
    }


def areal_workflows(tok):
    from areal.workflow.multi_turn import MultiTurnWorkflow
    from areal.workflow.rlvr import RLVRWorkflow

    return {
        "areal-rlvr": RLVRWorkflow(reward_len, areal_greedy(), tok),
        "areal-multi-turn": MultiTurnWorkflow(reward_len, areal_greedy(), tok, max_turns=2, turn_discount=0.9),
    }


def check_both_sides(items):
    """Both sides' checks; returns the batch with the trajectories in a canonical order (AReaL's executor returns
    them "sorted by creation time and shuffled", the kit's in input order)."""
    import torch
    from areal.infra import check_trajectory_format

    from areal_lite import check_trajectory, concat_padded_tensors

    assert isinstance(items, list) and items, "rollout_batch returns a non-empty list of trajectories"
    items = sorted(items, key=lambda it: it["input_ids"][0].tolist())
    for item in items:
        assert item["input_ids"].dtype == torch.int32 and item["loss_mask"].dtype == torch.int32
        assert item["versions"].dtype == torch.int32 and item["attention_mask"].dtype == torch.bool
        assert item["logprobs"].dtype == torch.float32 and item["rewards"].dtype == torch.float32
        assert item["input_ids"].shape[0] == G and item["rewards"].shape == (G,)
        check_trajectory_format(item)
    batch = concat_padded_tensors(items)
    check_trajectory(batch)
    return batch


def assert_same_batch(a, b):
    import torch

    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert a[key].shape == b[key].shape, key
        if key == "logprobs":
            torch.testing.assert_close(a[key], b[key], atol=1e-4, rtol=0)
        else:
            assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("name", ["rlvr", "reflection", "feedback", "search", "multi-turn"])
def test_kit_workflow_runs_under_areals_engine_as_under_ours(name, tok, rag_url, areal_engine, kit_engine):
    workflow = kit_workflows(tok, rag_url)[name]
    theirs = check_both_sides(areal_engine.rollout_batch(ROWS[:2], workflow=workflow, group_size=G))
    ours = check_both_sides(kit_engine.rollout_batch(ROWS[:2], workflow=workflow, group_size=G))
    assert_same_batch(theirs, ours)


@pytest.mark.parametrize("name", ["areal-rlvr", "areal-multi-turn"])
def test_areal_workflow_runs_under_our_engine_as_under_areals(name, tok, areal_engine, kit_engine):
    workflow = areal_workflows(tok)[name]
    theirs = check_both_sides(areal_engine.rollout_batch(ROWS[:2], workflow=workflow, group_size=G))
    ours = check_both_sides(kit_engine.rollout_batch(ROWS[:2], workflow=workflow, group_size=G))
    assert_same_batch(theirs, ours)


def test_kit_multi_turn_gives_areals_multi_turn_batch_on_both_engines(tok, areal_engine, kit_engine):
    """Same constructor call, same rows: AReaL's MultiTurnWorkflow and the kit's give the same batch (glue tokens,
    masks, versions, discounted rewards) under AReaL's engine and under the kit's."""
    import torch
    from areal.workflow.multi_turn import MultiTurnWorkflow as AReaLMultiTurn

    from areal_lite.workflow.multi_turn import MultiTurnWorkflow

    args = (reward_on_retry,)
    kw = dict(max_turns=2, turn_discount=0.9)
    ours = MultiTurnWorkflow(*args, greedy(), tok, **kw)
    theirs = AReaLMultiTurn(*args, areal_greedy(), tok, **kw)
    assert ours.multi_turn_prompt_ids == theirs.multi_turn_prompt_ids
    assert ours.gconfig.stop_token_ids == theirs.gconfig.stop_token_ids
    for engine in (areal_engine, kit_engine):
        kit_batch = check_both_sides(engine.rollout_batch(ROWS[:2], workflow=ours, group_size=G))
        areal_batch = check_both_sides(engine.rollout_batch(ROWS[:2], workflow=theirs, group_size=G))
        assert_same_batch(kit_batch, areal_batch)
        # Two turns each (the reward pays only the retry): two generated runs, reward 1.0 x 0.9.
        assert torch.allclose(kit_batch["rewards"], torch.full((2 * G,), 0.9))
        for row in range(2 * G):
            mask = kit_batch["loss_mask"][row][kit_batch["attention_mask"][row]]
            assert int((mask[1:] - mask[:-1] == 1).sum()) == 2, "two generated segments, separated by the retry"


def test_workflow_class_with_kwargs_and_prepare_batch_on_both_engines(tok, areal_engine, kit_engine):
    from torchdata.stateful_dataloader import StatefulDataLoader

    from areal_lite import RLVRWorkflow

    kwargs = {"reward_fn": reward_len, "gconfig": greedy(), "tokenizer": tok}
    loader = StatefulDataLoader(ROWS, batch_size=2, collate_fn=lambda rows: rows)
    for engine in (areal_engine, kit_engine):
        items = engine.prepare_batch(
            loader, workflow=RLVRWorkflow, workflow_kwargs=kwargs, group_size=G, should_accept_fn=lambda traj: True
        )
        assert len(items) == 2
        check_both_sides(items)
