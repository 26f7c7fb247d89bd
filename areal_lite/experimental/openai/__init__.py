"""The OpenAI-compatible agent layer, as AReaL 1.0.4's `areal.experimental.openai`.

- `types`: `InteractionWithTokenLogpReward`, one completion with its tokens, logprobs and reward, as a training row;
- `cache`: `InteractionCache`, a session's completions as a conversation tree: rewards, discount, export;
- `client`: `concat_prompt_token_ids_with_parent`, the prompt ids of a turn that extend its parent's exactly;
- `tool_call_parser`: Hermes `<tool_call>` blocks (or the compact `<tool>args</tool>` tag) -> OpenAI `tool_calls`;
- `chat_template`: a chat template applied token-exactly, so a conversation's ids extend the previous turn's;
- `proxy/`: the OpenAI-compatible server an unmodified agent talks to (`server`, its wire format `protocol`) and
  the workflow that runs such an agent (`workflow`).
"""

from areal_lite.experimental.openai.types import InteractionWithTokenLogpReward

__all__ = ["InteractionWithTokenLogpReward"]
