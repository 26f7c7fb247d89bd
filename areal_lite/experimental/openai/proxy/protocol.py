"""OpenAI's chat-completions wire format, pure: request bodies in, response bodies and stream chunks out.

Design decisions
- Pure functions and dataclasses, no HTTP and no model (like `kit.server.protocol`), so every rule is tested without a
  server and the handler in `proxy.server` stays thin.
- A bad body raises `ChatRequestError`, which carries OpenAI's error fields (`message`, `param`, `code`, HTTP
  status); messages say what was wrong and what to send instead.
- Unknown top-level fields are refused (OpenAI's "Unrecognized request argument"), which catches typos such as
  `max_token`. Bookkeeping fields are accepted and ignored (`user`, `metadata`, `seed`, ...). Fields that would change
  the answer in a way the kit cannot honour are refused unless neutral (`presence_penalty`, `logit_bias`,
  `top_logprobs > 0`, a non-text `response_format`, images): ignoring them would answer another question.
- `parallel_tool_calls=false` is honoured as vLLM honours it (the reply keeps its first tool call): LangChain sends it.
- `model` is any string: the server serves one model. vLLM's and SGLang's extras (`extra_body`) are accepted:
  `chat_template_kwargs`, `return_token_ids`, `top_k`.
- `chat_template_kwargs` are the template's own variables (`enable_thinking`, ...); the arguments the endpoint passes
  itself are refused with a 400 naming the key (`RESERVED_TEMPLATE_KWARGS`).
- Every accepted field is checked for type and range here, so the engine's own 4xx is the exception.
- `stream=true` is answered as server-sent events built from the finished completion (`stream_events`): generation
  is not streamed token by token, but clients that ask for a stream work and record the same interaction.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

__all__ = [
    "ChatRequestError",
    "ChatRequest",
    "parse_chat_request",
    "completion_body",
    "stream_events",
    "models_body",
    "error_body",
]

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_N = 16
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

_SUPPORTED = {
    "messages", "model", "tools", "tool_choice", "temperature", "top_p", "max_tokens", "max_completion_tokens",
    "stop", "n", "stream", "stream_options", "logprobs", "top_logprobs", "frequency_penalty", "presence_penalty",
    "logit_bias", "response_format", "chat_template_kwargs", "return_token_ids", "top_k", "store",
    "parallel_tool_calls",
}  # fmt: skip
# The arguments of transformers' apply_chat_template and of the template renderer (tests check the list against the
# installed transformers): the endpoint sets them, so chat_template_kwargs must not. Passed twice they would be
# a TypeError (a 500), and one that changes what comes back (`tokenize`, `return_dict`) would break the prompt silently.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "conversations", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})  # fmt: skip
_IGNORED = {
    "user", "metadata", "seed", "service_tier", "prompt_cache_key", "safety_identifier",
    "reasoning_effort", "modalities", "verbosity",
}  # fmt: skip


class ChatRequestError(ValueError):
    """A request the endpoint cannot serve as sent (answered with OpenAI's error shape)."""

    def __init__(self, message: str, param: Optional[str] = None, code: Optional[str] = None, status: int = 400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


def error_body(message: str, param: Optional[str] = None, code: Optional[str] = None, kind: Optional[str] = None):
    return {"error": {"message": message, "type": kind or "invalid_request_error", "param": param, "code": code}}


def _kind(v: Any) -> str:
    return "null" if v is None else type(v).__name__


@dataclass
class ChatRequest:
    """A validated chat-completions request (messages normalised; see `parse_chat_request`)."""

    messages: List[Dict[str, Any]]
    model: Optional[str] = None
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    max_tokens: Optional[int] = None
    stop: Optional[List[str]] = None
    n: int = 1
    stream: bool = False
    stream_usage: bool = False
    logprobs: bool = False
    frequency_penalty: Optional[float] = None
    return_token_ids: bool = False
    store: bool = True
    chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)

    @property
    def parses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


# ------------------------------------------------------------------------------------------------ fields


def _finite(v: float) -> bool:
    try:
        return math.isfinite(v)
    except OverflowError:  # an int past 1.8e308
        return False


def _number(body: dict, key: str, lo: float, hi: float, lo_open: bool = False) -> Optional[float]:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not _finite(v):
        raise ChatRequestError(f"'{key}' must be a finite number, got {_kind(v)}", key)
    if v < lo or v > hi or (lo_open and v == lo):
        raise ChatRequestError(f"'{key}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}", key)
    return float(v)


def _integer(body: dict, key: str, lo: int, hi: Optional[int] = None) -> Optional[int]:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ChatRequestError(f"'{key}' must be an integer, got {_kind(v)}", key)
    if v < lo or (hi is not None and v > hi):
        raise ChatRequestError(f"'{key}' must be between {lo} and {hi if hi is not None else 'any'}, got {v}", key)
    return v


def _flag(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ChatRequestError(f"'{key}' must be true or false, got {_kind(v)}", key)
    return v


def _content(m: dict, where: str) -> Optional[str]:
    """A message's content as text: a string, a list of text parts (joined), or None."""
    c = m.get("content")
    if c is None or isinstance(c, str):
        return c
    if not isinstance(c, list):
        raise ChatRequestError(f"{where}.content must be a string or a list of text parts, got {_kind(c)}", where)
    texts = []
    for j, part in enumerate(c):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in ("image_url", "input_audio", "file", "image"):
            raise ChatRequestError(f"{where}.content[{j}] is {kind!r}: this endpoint serves a text-only model", where)
        else:
            raise ChatRequestError(f"{where}.content[{j}] must be {{'type': 'text', 'text': str}}", where)
    return "".join(texts)


def _tool_calls(m: dict, where: str) -> List[Dict[str, Any]]:
    calls = m.get("tool_calls")
    if not isinstance(calls, list):
        raise ChatRequestError(f"{where}.tool_calls must be a list, got {_kind(calls)}", f"{where}.tool_calls")
    out = []
    for j, c in enumerate(calls):
        p = f"{where}.tool_calls[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ChatRequestError(f"{p} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}", p)
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        fn = {"name": fn["name"], "arguments": args}
        out.append({"id": str(c.get("id") or ""), "type": "function", "function": fn})
    return out


def _message(m: Any, i: int) -> Dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise ChatRequestError(f"{where} must be an object with 'role' and 'content', got {_kind(m)}", where)
    role = m.get("role")
    if role not in ROLES:
        raise ChatRequestError(f"{where}.role must be one of {list(ROLES)}, got {role!r}", f"{where}.role")
    out: Dict[str, Any] = {"role": "system" if role == "developer" else role, "content": _content(m, where)}
    if role == "assistant" and m.get("tool_calls"):
        out["tool_calls"] = _tool_calls(m, where)
    elif out["content"] is None:
        raise ChatRequestError(f"{where} ({role}) needs a 'content'", f"{where}.content")
    if role == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise ChatRequestError(f"{where} (tool) needs a string 'tool_call_id'", f"{where}.tool_call_id")
        out["tool_call_id"] = m["tool_call_id"]
    if isinstance(m.get("name"), str) and m["name"]:
        out["name"] = m["name"]
    return out


def _tools(body: dict) -> Optional[List[Dict[str, Any]]]:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ChatRequestError(f"'tools' must be a list, got {_kind(tools)}", "tools")
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise ChatRequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", f"tools[{i}]")
        name = fn.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.match(name):
            raise ChatRequestError(f"tools[{i}].function.name must match [A-Za-z0-9_-]{{1,64}}", f"tools[{i}]")
        params = fn.get("parameters", {})
        if not isinstance(params, dict):
            raise ChatRequestError(f"tools[{i}].function.parameters must be a JSON schema object", f"tools[{i}]")
        if not isinstance(params.get("properties", {}), dict):
            raise ChatRequestError(f"tools[{i}].function.parameters.properties must be an object", f"tools[{i}]")
        required = params.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ChatRequestError(f"tools[{i}].function.parameters.required must be a list of names", f"tools[{i}]")
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    return out or None


def _tool_choice(body: dict, tools: Optional[list]) -> Any:
    tc = body.get("tool_choice")
    if tc is None:
        return None
    if not tools:
        raise ChatRequestError("'tool_choice' is only allowed when 'tools' are given", "tool_choice")
    if tc in ("none", "auto", "required"):
        return tc
    fn = tc.get("function") if isinstance(tc, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or name not in {t["function"]["name"] for t in tools}:
        raise ChatRequestError(
            "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': <a tool>}}",
            "tool_choice",
        )
    return tc


def _stop(body: dict) -> Optional[List[str]]:
    stop = body.get("stop")
    if stop is None:
        return None
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not stop or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise ChatRequestError("'stop' must be a non-empty string or a list of up to 4 non-empty strings", "stop")
    return stop


def _refuse_unsupported(body: dict) -> None:
    unknown = sorted(set(body) - _SUPPORTED - _IGNORED)
    if unknown:
        hint = "; use 'tools' and 'tool_choice'" if {"functions", "function_call"} & set(unknown) else ""
        raise ChatRequestError(f"Unrecognized request argument supplied: {', '.join(unknown)}{hint}", unknown[0])
    if body.get("presence_penalty") not in (None, 0, 0.0):
        raise ChatRequestError("'presence_penalty' is not supported (use frequency_penalty)", "presence_penalty")
    if body.get("logit_bias") not in (None, {}):
        raise ChatRequestError("'logit_bias' is not supported", "logit_bias")
    if (_integer(body, "top_logprobs", 0, 20) or 0) > 0:
        msg = "'top_logprobs' > 0 is not supported (logprobs=true gives each token's own logprob)"
        raise ChatRequestError(msg, "top_logprobs")
    rf = body.get("response_format")
    if rf is not None and (not isinstance(rf, dict) or rf.get("type") != "text"):
        raise ChatRequestError("'response_format' other than {'type': 'text'} is not supported", "response_format")


def _template_kwargs(body: dict) -> Dict[str, Any]:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise ChatRequestError(f"'chat_template_kwargs' must be an object, got {_kind(kwargs)}", "chat_template_kwargs")
    taken = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if taken:
        raise ChatRequestError(
            f"'chat_template_kwargs' must not set {', '.join(repr(k) for k in taken)}: the endpoint sets it itself "
            "(chat_template_kwargs are the template's own variables, e.g. enable_thinking)",
            "chat_template_kwargs",
        )
    return kwargs


def _max_tokens(body: dict) -> Optional[int]:
    a, b = _integer(body, "max_tokens", 1), _integer(body, "max_completion_tokens", 1)
    if a is not None and b is not None and a != b:
        raise ChatRequestError("give 'max_completion_tokens' or 'max_tokens' (deprecated), not both", "max_tokens")
    return b if b is not None else a


def _check_tool_replies(messages: List[Dict[str, Any]]) -> None:
    """A `tool` message answers a call of the assistant turn before it (OpenAI's rule: a 400 otherwise), so the
    template never renders a result the conversation did not ask for."""
    open_ids: Optional[set] = None  # the call ids of the last assistant turn, while tool replies may follow it
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            open_ids = {c.get("id") for c in m.get("tool_calls") or []}
        elif m["role"] == "tool":
            if not open_ids or m["tool_call_id"] not in open_ids:
                raise ChatRequestError(
                    f"messages[{i}] (tool) must answer a call of the assistant message before it: its tool_call_id "
                    f"{m['tool_call_id']!r} is not among that message's tool_calls",
                    f"messages[{i}].tool_call_id",
                )
        else:
            open_ids = None


def parse_chat_request(body: Any) -> ChatRequest:
    """Validate a `POST /v1/chat/completions` body; raise `ChatRequestError` naming the offending field."""
    if not isinstance(body, dict):
        raise ChatRequestError(f"the request body must be a JSON object, got {_kind(body)}")
    _refuse_unsupported(body)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ChatRequestError("'messages' must be a non-empty list of messages", "messages")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ChatRequestError(f"'model' must be a string, got {_kind(model)}", "model")
    kwargs = _template_kwargs(body)
    stream = _flag(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and (not stream or not isinstance(opts, dict)):
        raise ChatRequestError("'stream_options' is an object, allowed only with stream=true", "stream_options")
    tools = _tools(body)
    messages = [_message(m, i) for i, m in enumerate(msgs)]
    _check_tool_replies(messages)
    return ChatRequest(
        messages=messages,
        model=model,
        tools=tools,
        tool_choice=_tool_choice(body, tools),
        parallel_tool_calls=_flag(body, "parallel_tool_calls", default=True),
        temperature=_number(body, "temperature", 0.0, 2.0),
        top_p=_number(body, "top_p", 0.0, 1.0, lo_open=True),
        top_k=_integer(body, "top_k", -1),
        max_tokens=_max_tokens(body),
        stop=_stop(body),
        n=_integer(body, "n", 1, MAX_N) or 1,
        stream=stream,
        stream_usage=_flag(opts or {}, "include_usage"),
        logprobs=_flag(body, "logprobs"),
        frequency_penalty=_number(body, "frequency_penalty", -2.0, 2.0),
        return_token_ids=_flag(body, "return_token_ids"),
        store=_flag(body, "store", default=True),
        chat_template_kwargs=dict(kwargs),
    )


# ------------------------------------------------------------------------------------------------ responses


@dataclass
class ChoiceResult:
    """One generated choice, ready to render."""

    message: Dict[str, Any]
    finish_reason: str
    token_ids: List[int]
    logprobs: List[float]
    token_texts: List[str]
    token_bytes: List[bytes] = field(default_factory=list)  # each token's own bytes; empty: its text's UTF-8


def _logprobs_body(c: ChoiceResult) -> Dict[str, Any]:
    raw = c.token_bytes or [t.encode("utf-8") for t in c.token_texts]
    return {
        "content": [
            {"token": t, "logprob": lp, "bytes": list(b), "top_logprobs": []}
            for t, lp, b in zip(c.token_texts, c.logprobs, raw)
        ],
        "refusal": None,
    }


def completion_body(
    cid: str, created: int, model: str, req: ChatRequest, prompt_ids: List[int], choices: List[ChoiceResult]
) -> Dict[str, Any]:
    """The `chat.completion` object of a finished request."""
    out_choices = []
    for i, c in enumerate(choices):
        ch: Dict[str, Any] = {"index": i, "message": c.message, "logprobs": None, "finish_reason": c.finish_reason}
        if req.logprobs:
            ch["logprobs"] = _logprobs_body(c)
        if req.return_token_ids:
            ch["token_ids"] = list(c.token_ids)
        out_choices.append(ch)
    completion_tokens = sum(len(c.token_ids) for c in choices)
    body = {
        "id": cid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": out_choices,
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": completion_tokens,
            "total_tokens": len(prompt_ids) + completion_tokens,
        },
    }
    if req.return_token_ids:
        body["prompt_token_ids"] = list(prompt_ids)
    return body


def stream_events(body: Dict[str, Any], req: ChatRequest) -> List[str]:
    """The server-sent events (`data: {...}\\n\\n`) that stream a finished `completion_body`: per choice one
    content chunk, one of tool calls (if any), one with the finish reason; then optionally usage, then `[DONE]`."""
    base = {k: body[k] for k in ("id", "created", "model", "system_fingerprint")}
    base["object"] = "chat.completion.chunk"
    chunks = []
    for ch in body["choices"]:
        msg, i = ch["message"], ch["index"]
        # null beside tool calls, as OpenAI streams it (the SDK then assembles content None, not "")
        first = {"role": "assistant", "content": msg.get("content") or (None if msg.get("tool_calls") else "")}
        chunks.append({"index": i, "delta": first, "logprobs": ch["logprobs"], "finish_reason": None})
        if msg.get("tool_calls"):
            calls = [{"index": j, **c} for j, c in enumerate(msg["tool_calls"])]
            chunks.append({"index": i, "delta": {"tool_calls": calls}, "logprobs": None, "finish_reason": None})
        chunks.append({"index": i, "delta": {}, "logprobs": None, "finish_reason": ch["finish_reason"]})
    events = [{**base, "choices": [c]} for c in chunks]
    if req.stream_usage:
        events.append({**base, "choices": [], "usage": body["usage"]})
    return [f"data: {json.dumps(e, ensure_ascii=False)}\n\n" for e in events] + ["data: [DONE]\n\n"]


def models_body(model: str, created: int) -> Dict[str, Any]:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "areal-lite"}]}
