"""The kit's counterpart of AReaL 1.0.4's `areal.experimental`: `openai/`, the OpenAI-compatible agent layer, and
`workflow/`, environments in TRL's and OpenEnv's shape trained as a workflow."""
