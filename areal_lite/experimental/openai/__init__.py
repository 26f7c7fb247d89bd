"""The OpenAI-compatible agent layer, as AReaL 1.0.4's `areal.experimental.openai`.

- `cache`: `InteractionCache`, the completions an agent made, with tokens and logprobs, turned into training rows;
- `tool_call_parser`: Hermes `<tool_call>` blocks in generated text -> OpenAI `tool_calls`;
- `chat_template`: a chat template applied token-exactly, so a conversation's ids extend the previous turn's;
- `proxy/`: the OpenAI-compatible server an unmodified agent talks to (`server`, its wire format `protocol`) and
  the workflow that runs such an agent (`workflow`).
"""
