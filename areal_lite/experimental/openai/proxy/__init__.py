"""The OpenAI-compatible endpoint in front of the inference engine, as AReaL 1.0.4's
`areal.experimental.openai.proxy`: `server` (`ChatServer`, `/v1/chat/completions` on 127.0.0.1), `protocol` (request
validation and response bodies) and `workflow` (`OpenAIAgentWorkflow`: an agent written against the `openai` SDK,
trained as it is).
"""
