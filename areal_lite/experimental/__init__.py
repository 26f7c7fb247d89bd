"""The kit's counterpart of AReaL 1.0.4's `areal.experimental`: only `openai/`, the OpenAI-compatible agent layer."""
