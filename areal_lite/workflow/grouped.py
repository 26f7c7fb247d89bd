"""`GroupedWorkflow`: G samples of one prompt as G contiguous rows, the group GRPO normalises within.

The engine's `group_size=` does the same (AReaL's rule); this wrapper is for code that calls a workflow directly.
Why `sort_rows` (on for the engine's `group_size=` and the kit's trainer): a group's G requests are identical, and
the server gives identical requests their random streams in the order they arrive, so which episode gets which
sample can change from run to run. In that order, the same G rows would reach the update in another order and its
sums would round differently: a seeded run would drift (docs/reliability.md). Sorted by content, they cannot.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Mapping
from typing import Any, Optional

import torch

from areal_lite.api.engine_api import InferenceEngine
from areal_lite.api.workflow_api import RolloutWorkflow
from areal_lite.utils.data import concat_padded_tensors
from areal_lite.workflow.rlvr import TensorDict

__all__ = ["GroupedWorkflow"]


class GroupedWorkflow(RolloutWorkflow):
    """Run `workflow` G times concurrently on the same data; return exactly G contiguous rows (a GRPO group).

    G is `workflow.gconfig.n_samples` unless `group_size` is given; giving both with different values (and
    n_samples != 1) is an error. The inner workflow is a shallow copy whose gconfig has `n_samples=1`.
    If any episode of the group is rejected (returns None) the whole group is rejected (None): a partial group
    would break the "G contiguous rows" layout that group normalisation relies on (AReaL 1.0.4's
    `GroupedRolloutWorkflow` keeps the survivors and returns a short group). If one raises, the others are
    cancelled and the exception propagates.

    Args:
        workflow: the inner workflow, run once per sample.
        group_size: G, when the inner workflow's gconfig does not say it.
        check_n_samples: refuse a `group_size` that disagrees with the inner gconfig's `n_samples`.
        sort_rows: return the G rows sorted by their contents rather than in the order the episodes were started
            (AReaL's order): a seeded run then repeats bit for bit (module docstring).

    Example: `GroupedWorkflow(RLVRWorkflow(reward_fn, gconfig, tokenizer), sort_rows=True)` runs
    `gconfig.n_samples` episodes per row.
    """

    def __init__(
        self, workflow, group_size: Optional[int] = None, *, check_n_samples: bool = True, sort_rows: bool = False
    ):
        gconfig = getattr(workflow, "gconfig", None)
        n = getattr(gconfig, "n_samples", None)
        if group_size is None:
            if n is None:
                raise ValueError("the inner workflow has no gconfig.n_samples; pass group_size")
            group_size = n
        elif check_n_samples and n is not None and n != 1 and n != group_size:
            raise ValueError(
                f"group size given twice and they disagree: group_size={group_size} but gconfig.n_samples={n}; "
                "set it once (gconfig.n_samples)"
            )
        if int(group_size) < 1:
            raise ValueError(f"group size must be >= 1, got {group_size}")
        self.group_size = int(group_size)
        self.sort_rows = sort_rows
        self.workflow = copy.copy(workflow)
        if gconfig is not None:
            self.workflow.gconfig = gconfig.new(n_samples=1)
            self.gconfig = gconfig.new(n_samples=self.group_size)

    async def arun_episode(self, engine: InferenceEngine, data: Mapping[str, Any]) -> Optional[TensorDict]:
        tasks = [asyncio.ensure_future(self.workflow.arun_episode(engine, data)) for _ in range(self.group_size)]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        if any(r is None for r in results):
            return None
        if self.sort_rows and all(isinstance(r, Mapping) for r in results):
            results = sorted(results, key=_content_key)
        return concat_padded_tensors(results)


def _content_key(episode: Mapping[str, Any]) -> tuple:
    """A total order on episodes by what they hold: each field's values, fields by name."""
    return tuple((k, v.tolist() if isinstance(v, torch.Tensor) else repr(v)) for k, v in sorted(episode.items()))
