"""Rollout workflows, as AReaL 1.0.4's `areal.workflow`: how one episode turns a data item into training tensors.

A workflow subclasses `RolloutWorkflow` and implements `async arun_episode(engine, data) -> dict[str, Tensor] | None`.
It asks the engine for tokens (`await engine.agenerate(ModelRequest)`), talks to tools or checkers, and returns the
tensor contract of `areal_lite.utils.trajectory` (one row). None means "rejected".

- `rlvr`: `RLVRWorkflow` (AReaL's name, path and constructor): one generation, one verifiable reward;
- `multi_turn`: `MultiTurnWorkflow` (AReaL's name, path and constructor): answer again while the reward is 0;
- `reflection`: the answer, then a request to check it and answer again (notebook 03);
- `search_agent`: think / search / answer against a retrieval server (notebook 05);
- `multi_turn_feedback`: feedback after each wrong answer, discounted per-turn returns (notebook 06);
- `grouped`: G samples of one prompt as G contiguous rows; `token_range`: a toy task for tests and benchmarks.
"""

from areal_lite.utils.lazy import lazy_exports

# AReaL's `areal.workflow` re-exports its workflows lazily; RLVRWorkflow and MultiTurnWorkflow are the ones the kit
# shares (its VisionRLVRWorkflow is not).
_LAZY_IMPORTS = {
    "RLVRWorkflow": "areal_lite.workflow.rlvr",
    "MultiTurnWorkflow": "areal_lite.workflow.multi_turn",
}

__all__ = sorted(_LAZY_IMPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY_IMPORTS)
