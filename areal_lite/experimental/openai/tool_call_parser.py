"""Tool calls in model text (Hermes / Qwen2.5 blocks, or a compact tag): parse a completion into OpenAI `tool_calls`.

A Hermes call is a block of JSON between tags, one block per call:
`<tool_call>{"name": "search", "arguments": {"query": "capital of Peru"}}</tool_call>`.

Design decisions
- Hermes blocks by default, the format Qwen2.5's chat template teaches (Hermes 2 Pro's): the kit's GPU model uses
  it natively, and SmolLM2's plain ChatML template, which knows nothing about tools, is taught it by
  `hermes_messages`.
- Parsing is all-or-nothing: when any block is malformed (bad JSON, no `name`, arguments not an object, a block left
  open by a length cut, a function the request did not offer) the whole completion is a plain text answer and
  `ToolCallParse.error` says why. A partial list would run some of what the model asked for and silently drop the
  rest. The caller counts these failures; nothing here raises on model output.
- `arguments` leave as a JSON string (OpenAI's shape), serialised with `ensure_ascii=False`, so a client that
  `json.loads` them gets exactly the object the model wrote.
- A compact syntax for small models (`tool_syntax="compact"`): the tool's name as a tag around its argument,
  `<calculator>12 * 34</calculator>`, far shorter than a Hermes block, so a 135M model writes calls it otherwise
  does not (bench/tool_exploration.py). The agent still sees standard OpenAI `tool_calls` either way.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

__all__ = [
    "ToolCallParse",
    "parse_tool_calls",
    "render_tool_calls",
    "tools_system_prompt",
    "hermes_messages",
    "native_tool_messages",
    "new_tool_call_id",
    "TOOL_SYNTAXES",
    "compact_messages",
    "compact_tools_prompt",
    "parse_compact_tool_calls",
    "render_compact_tool_calls",
]

TOOL_SYNTAXES = ("hermes", "compact")

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)

# Qwen2.5's wording, so the kit's GPU model sees the prompt it was tuned on whichever template renders it.
_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


@dataclass
class ToolCallParse:
    """What a completion's text means: the text left outside the blocks, the calls, or why it is plain text."""

    content: Optional[str]
    tool_calls: List[Dict[str, Any]] = field(default_factory=list)
    error: Optional[str] = None  # set when a block was malformed: content is then the whole text


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _openai_call(name: str, args: Dict[str, Any]) -> Dict[str, Any]:
    """An OpenAI tool call; `arguments` as the JSON string OpenAI sends (`ensure_ascii=False`: a client that
    `json.loads` it gets exactly the object the model wrote)."""
    return {
        "id": new_tool_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
    }


def _parse_block(body: str, allowed: Optional[set]) -> Dict[str, Any]:
    """One block's JSON -> an OpenAI tool call; ValueError says what is wrong with it."""
    try:
        obj = json.loads(body)
    except ValueError as e:
        raise ValueError(f"tool call is not valid JSON ({e}): {body.strip()[:80]!r}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"tool call must be a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"tool call has no function name: {body.strip()[:80]!r}")
    if allowed is not None and name not in allowed:
        raise ValueError(f"tool call names {name!r}, which is not among the offered tools {sorted(allowed)}")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string: accept it when it is one
        try:
            args = json.loads(args)
        except ValueError:
            raise ValueError(f"tool call arguments are a string that is not JSON: {args[:80]!r}") from None
    if not isinstance(args, dict):
        raise ValueError(f"tool call arguments must be a JSON object, got {type(args).__name__}")
    return _openai_call(name, args)


def _reason(e: Exception) -> str:
    return "tool call JSON is nested too deeply" if isinstance(e, RecursionError) else str(e)


def parse_tool_calls(text: str, tool_names: Optional[Iterable[str]] = None) -> ToolCallParse:
    """Split `text` into content and Hermes tool calls (see the module docstring; never raises on model output).

    `tool_names`: the functions the request offered; a call to any other name makes the completion plain text.
    """
    allowed = None if tool_names is None else set(tool_names)
    if TOOL_CALL_OPEN not in text:
        return ToolCallParse(content=text)
    calls: List[Dict[str, Any]] = []
    try:
        for m in _BLOCK.finditer(text):
            calls.append(_parse_block(m.group(1), allowed))
        rest = _BLOCK.sub("", text)
        if TOOL_CALL_OPEN in rest:
            raise ValueError("a <tool_call> block is not closed (the completion was probably cut by max_tokens)")
    except (ValueError, RecursionError) as e:  # RecursionError: JSON nested past Python's stack, still bad output
        return ToolCallParse(content=text, error=_reason(e))
    rest = rest.strip()
    return ToolCallParse(content=rest or None, tool_calls=calls)


def _arguments_object(arguments: Any) -> Any:
    """`function.arguments` (a JSON string in OpenAI's shape) as an object, or as given when it is not JSON."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except (ValueError, RecursionError):
            return arguments
    return arguments


def render_tool_calls(content: Optional[str], tool_calls: Sequence[Mapping[str, Any]]) -> str:
    """An assistant message's text in Hermes format: its content, then one `<tool_call>` block per call."""
    parts = [content] if content else []
    for call in tool_calls:
        fn = call.get("function") or {}
        obj = {"name": fn.get("name"), "arguments": _arguments_object(fn.get("arguments", {}))}
        parts.append(f"{TOOL_CALL_OPEN}\n{json.dumps(obj, ensure_ascii=False)}\n{TOOL_CALL_CLOSE}")
    return "\n".join(parts)


def tools_system_prompt(tools: Sequence[Mapping[str, Any]], system: Optional[str] = None) -> str:
    """The system prompt that offers `tools` in Hermes format, after `system` when there is one."""
    listed = "".join("\n" + json.dumps(dict(t), ensure_ascii=False) for t in tools)
    block = _TOOLS_HEADER + listed + _TOOLS_FOOTER
    return f"{system}\n\n{block}" if system else block


def _rewrite(messages, tools, call_text, result_text, tools_prompt) -> List[dict]:
    """A conversation as text turns: assistant calls through `call_text(content, calls)`, each run of tool results
    as one user turn of `result_text(content)` blocks, the tool list in the system prompt by `tools_prompt`."""
    out: List[dict] = []
    pending: List[str] = []

    def flush() -> None:
        if pending:
            out.append({"role": "user", "content": "\n".join(pending)})
            pending.clear()

    for m in messages:
        role = m.get("role")
        if role == "tool":
            pending.append(result_text(m.get("content") or ""))
            continue
        flush()
        if role == "assistant" and m.get("tool_calls"):
            out.append({"role": "assistant", "content": call_text(m.get("content"), m["tool_calls"])})
        else:
            out.append({"role": role, "content": m.get("content") or ""})
    flush()
    if tools:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": tools_prompt(tools, out[0]["content"])}
        else:
            out.insert(0, {"role": "system", "content": tools_prompt(tools)})
    return out


def hermes_messages(messages: Sequence[Mapping[str, Any]], tools: Optional[Sequence[Mapping]]) -> List[dict]:
    """The conversation rewritten for a template without tool support: the tool list goes into the system prompt
    (appended to the conversation's own system message, or as a new first message, which replaces a template's
    default system prompt such as SmolLM2's), an assistant message's `tool_calls` become `<tool_call>` blocks after
    its text, and consecutive `role="tool"` messages become one user message of `<tool_response>` blocks -- the
    text Qwen2.5's template renders for the same conversation. Templates that render `tools` themselves get
    `native_tool_messages` instead."""
    return _rewrite(
        messages,
        tools,
        render_tool_calls,
        lambda content: f"<tool_response>\n{content}\n</tool_response>",
        tools_system_prompt,
    )


def native_tool_messages(messages: Sequence[Mapping[str, Any]]) -> List[dict]:
    """The conversation for a template that renders tools itself: arguments as objects (what such templates
    expect: Qwen2.5's would otherwise write a JSON string inside the JSON of the call)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = dict(c.get("function") or {})
                fn["arguments"] = _arguments_object(fn.get("arguments", {}))
                calls.append({**c, "function": fn})
            m["tool_calls"] = calls
        out.append(m)
    return out


# ------------------------------------------------------------------------------------------------ compact syntax

RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"


def _parameters(tool: Mapping[str, Any]) -> List[str]:
    """A function tool's parameter names, required ones first (the order a one-argument call relies on)."""
    params = (tool.get("function") or {}).get("parameters") or {}
    names = list((params.get("properties") or {}).keys())
    required = [n for n in params.get("required") or [] if n in names]
    return required + [n for n in names if n not in required]


def _compact_call_text(name: str, params: Sequence[str], arguments: Any) -> str:
    args = _arguments_object(arguments)
    if len(params) == 1 and isinstance(args, dict) and set(args) <= {params[0]}:
        body = str(args.get(params[0], ""))
    elif not params and not args:
        body = ""
    else:
        body = json.dumps(args, ensure_ascii=False)
    return f"<{name}>{body}</{name}>"


def compact_tools_prompt(tools: Sequence[Mapping[str, Any]], system: Optional[str] = None) -> str:
    """The system prompt that offers `tools` in the compact syntax, after `system` when there is one."""
    lines = ["# Tools", "", "To call a tool, write its call as shown; its result comes back as <result>value</result>."]
    for t in tools:
        fn = t.get("function") or {}
        params = _parameters(t)
        if len(params) == 1:
            shape = f"<{fn.get('name')}>{params[0]}</{fn.get('name')}>"
        elif not params:
            shape = f"<{fn.get('name')}></{fn.get('name')}>"
        else:
            shape = f"<{fn.get('name')}>{{" + ", ".join(f'"{p}": ...' for p in params) + f"}}</{fn.get('name')}>"
        lines.append(f"{shape}: {fn.get('description') or ''}".rstrip(": "))
    block = "\n".join(lines)
    return f"{system}\n\n{block}" if system else block


def render_compact_tool_calls(
    content: Optional[str], tool_calls: Sequence[Mapping[str, Any]], tools: Optional[Sequence[Mapping]]
) -> str:
    """An assistant message's text in the compact syntax: its content, then one tag per call."""
    params = {(t.get("function") or {}).get("name"): _parameters(t) for t in tools or []}
    parts = [content] if content else []
    for call in tool_calls:
        fn = call.get("function") or {}
        parts.append(_compact_call_text(fn.get("name"), params.get(fn.get("name"), []), fn.get("arguments", {})))
    return "\n".join(parts)


def compact_messages(messages: Sequence[Mapping[str, Any]], tools: Optional[Sequence[Mapping]]) -> List[dict]:
    """`hermes_messages` in the compact syntax: calls as tags, results as `<result>` blocks in a user turn.

    A call is the tool's name as a tag around its argument: the bare value for a tool with one parameter, a JSON
    object for several, nothing for none. Parsing keeps the all-or-nothing rule (a tag left open is a failure)."""
    return _rewrite(
        messages,
        tools,
        lambda content, calls: render_compact_tool_calls(content, calls, tools),
        lambda content: f"{RESULT_OPEN}{content}{RESULT_CLOSE}",
        compact_tools_prompt,
    )


def parse_compact_tool_calls(text: str, tools: Optional[Sequence[Mapping[str, Any]]]) -> ToolCallParse:
    """`parse_tool_calls` for the compact syntax: `<name>argument</name>` for each offered tool `name`."""
    params = {(t.get("function") or {}).get("name"): _parameters(t) for t in tools or []}
    names = [n for n in params if n]
    if not names or not any(f"<{n}>" in text for n in names):
        return ToolCallParse(content=text)
    pattern = re.compile("<(" + "|".join(re.escape(n) for n in names) + r")>(.*?)</\1>", re.DOTALL)
    calls: List[Dict[str, Any]] = []
    try:
        for m in pattern.finditer(text):
            name, body = m.group(1), m.group(2).strip()
            p = params[name]
            if len(p) == 1 and not body.startswith("{"):
                args: Any = {p[0]: body}
            elif not body:
                args = {}
            else:
                try:
                    args = json.loads(body)
                except ValueError as e:
                    raise ValueError(f"<{name}> arguments are not a JSON object ({e}): {body[:80]!r}") from None
                if not isinstance(args, dict):
                    raise ValueError(f"<{name}> arguments must be a JSON object, got {type(args).__name__}")
            calls.append(_openai_call(name, args))
        rest = pattern.sub("", text)
        left_open = [n for n in names if f"<{n}>" in rest]
        if left_open:
            raise ValueError(f"a <{left_open[0]}> call is not closed (the completion was probably cut by max_tokens)")
    except (ValueError, RecursionError) as e:
        return ToolCallParse(content=text, error=_reason(e))
    return ToolCallParse(content=rest.strip() or None, tool_calls=calls)
