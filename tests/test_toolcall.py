"""Hermes and compact tool calls (`experimental.openai.tool_call_parser`) and the token-exact chat template
(`experimental.openai.chat_template`).

Parsing is checked on hand-written completions (the model's output is under our control only as text); the template
on SmolLM2's real tokenizer, whose plain ChatML template ignores `tools` and so exercises the Hermes rewriting.
"""

from __future__ import annotations

import json

import pytest

from areal_lite.experimental.openai.chat_template import ChatTemplate
from areal_lite.experimental.openai.tool_call_parser import (
    compact_messages,
    compact_tools_prompt,
    hermes_messages,
    native_tool_messages,
    parse_compact_tool_calls,
    parse_tool_calls,
    render_compact_tool_calls,
    render_tool_calls,
    tools_system_prompt,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        },
    },
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}},
]


# ------------------------------------------------------------------------------------------------ parsing


def test_parse_one_call_with_text_around():
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    p = parse_tool_calls(text, ["add", "search"])
    assert p.error is None and p.content == "Let me add."
    [call] = p.tool_calls
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "add" and json.loads(call["function"]["arguments"]) == {"a": 1, "b": 2}


def test_parse_several_calls_no_text_and_unicode():
    text = (
        '<tool_call>{"name": "search", "arguments": {"query": "Pérou"}}</tool_call>\n'
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3}"}</tool_call>'
    )
    p = parse_tool_calls(text)
    assert p.content is None and [c["function"]["name"] for c in p.tool_calls] == ["search", "add"]
    assert "Pérou" in p.tool_calls[0]["function"]["arguments"]  # ensure_ascii=False: the model's text, unescaped
    assert json.loads(p.tool_calls[1]["function"]["arguments"]) == {"a": 3}  # a JSON string of arguments is accepted
    assert p.tool_calls[0]["id"] != p.tool_calls[1]["id"]


def test_plain_text_is_content():
    p = parse_tool_calls("The answer is 3.")
    assert p.content == "The answer is 3." and p.tool_calls == [] and p.error is None


@pytest.mark.parametrize(
    "text, why",
    [
        ('<tool_call>{"name": "add", "arguments": {"a": 1}</tool_call>', "not valid JSON"),
        ('<tool_call>{"arguments": {"a": 1}}</tool_call>', "no function name"),
        ('<tool_call>["add"]</tool_call>', "JSON object"),
        ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', "arguments must be a JSON object"),
        ('<tool_call>{"name": "add", "arguments": "a=1"}</tool_call>', "string that is not JSON"),
        ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', "not among the offered tools"),
        ('<tool_call>{"name": "add", "arguments": {"a": 1}}', "not closed"),
        ('<tool_call>{"name": "add", "arguments": {}}</tool_call> and <tool_call>{"name": ', "not closed"),
        # nested past Python's recursion limit: still the model's bad output, never an exception (a 500)
        ('<tool_call>{"name": "add", "arguments": {"a": ' + "[" * 5000 + "]" * 5000 + "}}</tool_call>", "too deeply"),
        ('<tool_call>{"name": "add", "arguments": "' + "[" * 5000 + "]" * 5000 + '"}</tool_call>', "too deeply"),
    ],
)
def test_malformed_calls_become_text_with_a_reason(text, why):
    p = parse_tool_calls(text, ["add", "search"])
    assert p.tool_calls == [] and p.content == text  # all or nothing: the whole completion is the answer
    assert why in p.error


# ------------------------------------------------------------------------------------------------ rendering


def test_render_round_trips_through_the_parser():
    calls = [{"id": "call_x", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]
    text = render_tool_calls("Adding.", calls)
    assert text == 'Adding.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    p = parse_tool_calls(text, ["add"])
    assert p.content == "Adding." and p.tool_calls[0]["function"] == calls[0]["function"]


def test_hermes_messages_rewrites_tools_calls_and_results():
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": None, "tool_calls": [call, call]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ]
    out = hermes_messages(msgs, TOOLS)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools") and '"name": "search"' in out[0]["content"]
    assert out[2]["content"].count("<tool_call>") == 2
    assert out[3]["content"] == "<tool_response>\n3\n</tool_response>\n<tool_response>\n3\n</tool_response>"
    # no system message: one is inserted; no tools: nothing is added; None content renders as ""
    assert hermes_messages(msgs[1:2], TOOLS)[0]["content"] == tools_system_prompt(TOOLS)
    assert hermes_messages([{"role": "assistant", "content": None}], None) == [{"role": "assistant", "content": ""}]


def test_native_tool_messages_parse_arguments():
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    out = native_tool_messages([{"role": "assistant", "content": None, "tool_calls": [call]}])
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert call["function"]["arguments"] == '{"a": 1}'  # the caller's message is not modified
    deep = {"id": "c2", "type": "function", "function": {"name": "add", "arguments": "[" * 5000 + "]" * 5000}}
    out = native_tool_messages([{"role": "assistant", "content": None, "tool_calls": [deep]}])
    assert out[0]["tool_calls"][0]["function"]["arguments"] == "[" * 5000 + "]" * 5000  # not JSON we can read: as is


# ------------------------------------------------------------------------------------------------ compact syntax

CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an expression",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
COMPACT_TOOLS = [CALC, TOOLS[0], NOW]  # one parameter, two, none


def _call(name, arguments):
    return {"id": "c1", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


@pytest.mark.parametrize(
    "call, text",
    [
        (_call("calculator", {"expression": "12 * 34"}), "<calculator>12 * 34</calculator>"),
        (_call("add", {"a": 1, "b": 2}), '<add>{"a": 1, "b": 2}</add>'),
        (_call("now", {}), "<now></now>"),
    ],
)
def test_compact_calls_round_trip(call, text):
    assert render_compact_tool_calls(None, [call], COMPACT_TOOLS) == text
    p = parse_compact_tool_calls(f"Let me see.\n{text}", COMPACT_TOOLS)
    assert p.error is None and p.content == "Let me see."
    assert [c["function"] for c in p.tool_calls] == [call["function"]]


def test_compact_prompt_shows_each_call_shape():
    prompt = compact_tools_prompt(COMPACT_TOOLS, "Be brief.")
    assert prompt.startswith("Be brief.\n\n# Tools")
    for shape in (
        "<calculator>expression</calculator>: Evaluate an expression",
        '<add>{"a": ..., "b": ...}</add>',
        "<now></now>",
        "<result>value</result>",
    ):
        assert shape in prompt


@pytest.mark.parametrize(
    "text, why",
    [
        ("<calculator>12 * 34", "not closed"),
        ("<calculator>1</calculator> then <calculator>2 *", "not closed"),
        ("<add>a=1</add>", "not a JSON object"),
        ("<add>[1, 2]</add>", "must be a JSON object"),
        ('<add>{"a": ' + "[" * 5000 + "]" * 5000 + "}</add>", "too deeply"),
    ],
)
def test_compact_malformed_calls_are_text_with_a_reason(text, why):
    p = parse_compact_tool_calls(text, COMPACT_TOOLS)
    assert p.tool_calls == [] and p.content == text and why in p.error


def test_compact_ignores_tags_of_tools_not_offered_and_plain_text():
    assert parse_compact_tool_calls("<search>x</search> 42", COMPACT_TOOLS).tool_calls == []
    assert parse_compact_tool_calls("<calculator>1+1</calculator>", [TOOLS[0]]).tool_calls == []
    assert parse_compact_tool_calls("42", None).content == "42"


def test_compact_messages_rewrite_calls_and_results():
    msgs = [
        {"role": "user", "content": "What is 12 * 34?"},
        {"role": "assistant", "content": "", "tool_calls": [_call("calculator", {"expression": "12 * 34"})]},
        {"role": "tool", "tool_call_id": "c1", "content": "408"},
        {"role": "assistant", "content": "408"},
    ]
    out = compact_messages(msgs, [CALC])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user", "assistant"]
    assert out[0]["content"] == compact_tools_prompt([CALC])
    assert out[2]["content"] == "<calculator>12 * 34</calculator>" and out[3]["content"] == "<result>408</result>"


# ------------------------------------------------------------------------------------------------ template


@pytest.fixture(scope="module")
def smol_tok(smollm_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_path)


@pytest.fixture(scope="module")
def template(smol_tok):
    return ChatTemplate(smol_tok)


def _enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_template_probe_and_stop_tokens(template, smol_tok):
    im_end = smol_tok.convert_tokens_to_ids("<|im_end|>")
    assert template.native_tools is False  # SmolLM2's ChatML ignores `tools`
    assert template.end_of_turn[0] == im_end and smol_tok.decode(template.end_of_turn) == "<|im_end|>\n"
    assert im_end in template.stop_token_ids and smol_tok.eos_token_id in template.stop_token_ids


def test_render_puts_tools_in_the_system_prompt(template, smol_tok):
    text = smol_tok.decode(template.render([{"role": "user", "content": "1+2?"}], TOOLS))
    assert text.startswith("<|im_start|>system\n# Tools") and "SmolLM" not in text  # replaces the default prompt
    assert text.endswith("<|im_start|>user\n1+2?<|im_end|>\n<|im_start|>assistant\n")


def test_continue_without_drift_uses_the_rendering(template, smol_tok):
    msgs = [{"role": "user", "content": "Hi"}]
    prompt = template.render(msgs)
    out = _enc(smol_tok, "Hello there") + [template.anchor]  # stopped on <|im_end|>
    full = template.render(msgs + [{"role": "assistant", "content": "Hello there"}, {"role": "user", "content": "?"}])
    cont = template.continue_from(prompt, out, full)
    assert cont.drift is False and cont.input_ids == full and cont.input_ids[: len(prompt) + len(out)] == prompt + out


def test_continue_with_drift_keeps_the_generated_ids(template, smol_tok):
    msgs = [{"role": "user", "content": "Hi"}]
    prompt = template.render(msgs)
    # generated with odd spacing and cut by length (no <|im_end|>): the template writes it back trimmed
    out = _enc(smol_tok, "  Hello   there ")
    full = template.render(msgs + [{"role": "assistant", "content": "Hello there"}, {"role": "user", "content": "?"}])
    cont = template.continue_from(prompt, out, full)
    assert cont.drift is True
    n = len(prompt) + len(out)
    assert cont.input_ids[:n] == prompt + out  # exactly what was sampled
    assert cont.input_ids[n : n + 2] == template.end_of_turn  # the turn closed by the template's own tokens
    assert smol_tok.decode(cont.input_ids[n:]) == "<|im_end|>\n<|im_start|>user\n?<|im_end|>\n<|im_start|>assistant\n"


def test_continue_refuses_a_conversation_it_cannot_align(template, smol_tok):
    prompt = template.render([{"role": "user", "content": "Hi"}])
    out = _enc(smol_tok, "Hello") + [template.anchor]
    # fewer messages than the parent had: no anchor to continue from
    short = template.render([{"role": "user", "content": "x"}])
    assert template.continue_from(prompt + out + prompt, out, short) is None


def test_compact_template_renders_and_parses_its_syntax(smol_tok):
    compact = ChatTemplate(smol_tok, tool_syntax="compact")
    assert compact.tool_syntax == "compact" and ChatTemplate(smol_tok).tool_syntax == "hermes"
    msgs = [{"role": "user", "content": "What is 12 * 34?"}]
    text = smol_tok.decode(compact.render(msgs, [CALC]))
    assert "<calculator>expression</calculator>" in text and "<tool_call>" not in text
    [call] = compact.parse_tool_calls("<calculator>12 * 34</calculator>", [CALC]).tool_calls
    assert json.loads(call["function"]["arguments"]) == {"expression": "12 * 34"}
    with pytest.raises(ValueError, match="tool_syntax must be one of"):
        ChatTemplate(smol_tok, tool_syntax="json")
