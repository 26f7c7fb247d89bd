"""`RolloutWorkflow`, the base class of every workflow (AReaL 1.0.4's `areal.api.workflow_api`): one episode per
`arun_episode(engine, data)` call, returning the tensor contract or None.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Dict, Optional

from areal_lite.api.engine_api import InferenceEngine

if TYPE_CHECKING:
    import torch

__all__ = ["RolloutWorkflow"]

TensorDict = Dict[str, "torch.Tensor"]


class RolloutWorkflow(abc.ABC):
    """Base class: one episode per call. Subclasses implement `arun_episode` (AReaL's abstract method).

    An abstract base class, like AReaL's: `areal_lite.kit.areal.compat.register_with_areal()` registers it as a virtual
    subclass of `areal.api.RolloutWorkflow`, so AReaL's engine accepts every kit workflow.
    """

    @abc.abstractmethod
    async def arun_episode(self, engine: InferenceEngine, data: Mapping[str, Any]) -> Optional[TensorDict]:
        """Run one episode on `data`; return the tensor contract (or None to reject it)."""
        raise NotImplementedError
