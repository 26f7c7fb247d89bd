"""The engine contracts, at AReaL 1.0.4's path `areal.api.engine_api`: what a trainer and a workflow may call.

`TrainEngine` is the trainer side (the kit's `FSDPPPOActor`), `InferenceEngine` the rollout side (the kit's
`RemoteSGLangEngine` and `RemotevLLMEngine`). Both carry AReaL's method names and signatures for the part the kit
implements, so `from areal_lite.api.engine_api import InferenceEngine` in a type hint converts to AReaL unchanged.
Like AReaL's, the methods raise NotImplementedError rather than being abstract: an engine implements what it
supports. AReaL's distributed-group queries, offloading and profiling hooks have no kit counterpart.
"""

from __future__ import annotations

import abc
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch

    from areal_lite.api.io_struct import ModelRequest, ModelResponse, WeightUpdateMeta


class TrainEngine(abc.ABC):  # noqa: B024 (as AReaL's: no abstract method, an engine implements what it supports)
    """The trainer: owns the policy's weights, takes PPO steps, publishes weights to an `InferenceEngine`."""

    def create_process_group(self, parallel_strategy: Any | None = None) -> None:
        raise NotImplementedError()

    def initialize(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError()

    def destroy(self) -> None:
        raise NotImplementedError()

    def connect_engine(self, engine: InferenceEngine, meta: WeightUpdateMeta) -> None:
        raise NotImplementedError()

    def update_weights(self, meta: WeightUpdateMeta) -> None:
        raise NotImplementedError()

    def set_version(self, version: int) -> None:
        raise NotImplementedError()

    def get_version(self) -> int:
        raise NotImplementedError()

    def step_lr_scheduler(self) -> None:
        raise NotImplementedError()

    def train_batch(
        self,
        input_: list[dict[str, Any]] | dict[str, Any],
        loss_fn: Callable[..., torch.Tensor],
        loss_weight_fn: Callable[[dict[str, Any]], torch.Tensor],
    ) -> dict[str, float]:
        raise NotImplementedError()


class InferenceEngine(abc.ABC):  # noqa: B024 (as TrainEngine)
    """The rollout side: generates tokens, runs workflow episodes, takes new weights between steps."""

    def initialize(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError()

    def destroy(self) -> None:
        raise NotImplementedError()

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        raise NotImplementedError()

    def update_weights_from_disk(self, meta: WeightUpdateMeta) -> Future[None]:
        raise NotImplementedError()

    def update_weights(self, meta: WeightUpdateMeta, timeout: float | None = None) -> Future[int]:
        """The kit's: load the next weight version whatever its route (disk or NCCL), as the seeds' loops call it.
        AReaL 1.0.4 routes weights through `TrainEngine.connect_engine` instead; the kit's actor supports both."""
        raise NotImplementedError()

    def set_version(self, version: int) -> None:
        raise NotImplementedError()

    def get_version(self) -> int:
        raise NotImplementedError()

    def submit(
        self,
        data: dict[str, Any],
        workflow: Any,
        workflow_kwargs: dict[str, Any] | None = None,
        should_accept_fn: Callable | None = None,
        group_size: int = 1,
        task_id: int | None = None,
        is_eval: bool = False,
    ) -> int:
        raise NotImplementedError()

    def wait(self, count: int, timeout: float | None = None, raise_timeout: bool = True) -> list[dict[str, Any] | None]:
        raise NotImplementedError()

    def rollout_batch(
        self,
        data: list[dict[str, Any]],
        workflow: Any,
        workflow_kwargs: dict[str, Any] | None = None,
        group_size: int = 1,
    ) -> list[dict[str, Any]]:
        raise NotImplementedError()

    def prepare_batch(
        self,
        dataloader: Any,
        workflow: Any,
        workflow_kwargs: dict[str, Any] | None = None,
        should_accept_fn: Callable | None = None,
        group_size: int = 1,
        dynamic_bs: bool = False,
    ) -> list[dict[str, Any]]:
        raise NotImplementedError()

    def pause(self) -> None:
        raise NotImplementedError()

    def resume(self) -> None:
        raise NotImplementedError()


__all__ = ["TrainEngine", "InferenceEngine"]
