"""`TokenRangeWorkflow`: a toy task a tiny *random* model learns in seconds (used by the training test and the
async-vs-sync benchmark, where a real task would need a real model).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from areal_lite.api.cli_args import GenerationHyperparameters
from areal_lite.api.engine_api import InferenceEngine
from areal_lite.api.io_struct import ModelRequest
from areal_lite.api.workflow_api import RolloutWorkflow
from areal_lite.utils.hf_utils import chat_prompt_ids
from areal_lite.utils.trajectory import TrajectoryBuilder
from areal_lite.workflow.rlvr import TensorDict, _single

__all__ = ["TokenRangeWorkflow"]


class TokenRangeWorkflow(RolloutWorkflow):
    """A toy task a tiny *random* model can learn in seconds: reward = fraction of output ids in [lo, hi).

    Used by the end-to-end training test and `bench/async_vs_sync.py`, where a real task would need a real model.
    The prompt is `data["question"]` through the chat template; one generation; no reward worker process.
    """

    def __init__(self, tokenizer, gconfig: GenerationHyperparameters, lo: int = 100, hi: int = 1124):
        self.tokenizer, self.gconfig, self.lo, self.hi = tokenizer, gconfig, int(lo), int(hi)

    async def arun_episode(self, engine: InferenceEngine, data: Mapping[str, Any]) -> TensorDict:
        ids = chat_prompt_ids(self.tokenizer, [{"role": "user", "content": data["question"]}])
        req = ModelRequest(input_ids=ids, gconfig=_single(self.gconfig), tokenizer=self.tokenizer)
        resp = await engine.agenerate(req)
        out = resp.output_tokens
        reward = sum(self.lo <= t < self.hi for t in out) / max(1, len(out))
        return TrajectoryBuilder().add_prompt(ids).add_output(resp).to_tensors(reward)
