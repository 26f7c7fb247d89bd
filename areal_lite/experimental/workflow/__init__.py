"""Workflows beyond AReaL 1.0.4's stable set, as its `areal.experimental.workflow` package.

- `environment`: `EnvironmentWorkflow`, any TRL/OpenEnv-shaped environment class trained as a workflow (notebook 11).
"""
