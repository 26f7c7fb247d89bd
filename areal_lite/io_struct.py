"""The small records passed between workflows, the rollout engine and the trainer (AReaL's names).

Design decisions
- Requests and responses are token-in/token-out. A multi-turn workflow appends the returned `output_tokens` to its
  context and never re-tokenizes text the model generated, so what is trained on is exactly what was sampled.
- Every output token carries the policy version that produced it (`output_versions`): a request interrupted by a
  weight update resumes with the new weights, and its tokens then span two versions.
- Weight updates go through disk by default: the trainer writes version k to `<path>/v<k>` (a temporary folder
  renamed into place, so a reader never sees half a checkpoint) and the servers load that folder.
"""

from __future__ import annotations

import math
import os
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from .config import GenerationHyperparameters

__all__ = ["ModelRequest", "ModelResponse", "WeightUpdateMeta", "FinetuneSpec", "weight_dir"]


@dataclass
class ModelRequest:
    """One generation request: a prompt as token ids and how to sample it."""

    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    input_ids: List[int] = field(default_factory=list)
    gconfig: GenerationHyperparameters = field(default_factory=GenerationHyperparameters)
    metadata: Dict[str, Any] = field(default_factory=dict)
    text: Optional[str] = None

    def copy(self) -> "ModelRequest":
        return ModelRequest(
            rid=self.rid,
            input_ids=list(self.input_ids),
            gconfig=self.gconfig.new(),
            metadata=dict(self.metadata),
            text=self.text,
        )


@dataclass
class ModelResponse:
    """What came back: the prompt, the new tokens with their logprobs and versions, and why it stopped."""

    input_tokens: List[int] = field(default_factory=list)
    output_tokens: List[int] = field(default_factory=list)
    output_logprobs: List[float] = field(default_factory=list)
    output_versions: List[int] = field(default_factory=list)
    stop_reason: str = "stop"  # "stop" (EOS, stop token or stop string), "length", or "abort"
    latency: float = float("inf")
    ttft: float = float("inf")  # time to first token
    rid: str = ""

    @property
    def input_len(self) -> int:
        return len(self.input_tokens)

    @property
    def output_len(self) -> int:
        return len(self.output_tokens)


def weight_dir(root: str, version: int) -> str:
    """Where the weights of policy version `version` live in a disk weight update."""
    return os.path.join(root, f"v{int(version)}")


@dataclass
class WeightUpdateMeta:
    """How new weights travel from the trainer to the inference servers."""

    type: str = "disk"  # "disk" or "nccl"
    path: Optional[str] = None  # disk: the folder that holds v<k> subfolders
    nccl_master_address: str = "127.0.0.1"
    nccl_master_port: int = 0
    nccl_group_name: str = "areal_lite_weights"
    keep_last: int = 2  # disk: older version folders are deleted by the writer

    @classmethod
    def from_disk(cls, path: str, keep_last: int = 2) -> "WeightUpdateMeta":
        """Weights go through files under `path` (put it on /dev/shm when it exists: it is RAM)."""
        return cls(type="disk", path=os.path.abspath(path), keep_last=keep_last)

    @classmethod
    def from_nccl(cls, master_address: str, master_port: int, group_name: str = "areal_lite_weights"):
        """Weights are broadcast from trainer rank 0 to the SGLang servers over NCCL (GPU only)."""
        return cls(
            type="nccl",
            nccl_master_address=master_address,
            nccl_master_port=int(master_port),
            nccl_group_name=group_name,
        )

    def dir_for(self, version: int) -> str:
        if self.type != "disk" or not self.path:
            raise ValueError("dir_for() is only meaningful for a disk weight update with a path")
        return weight_dir(self.path, version)


@dataclass
class FinetuneSpec:
    """Sizes the learning-rate schedule needs."""

    total_train_epochs: int
    dataset_size: int
    train_batch_size: int

    @property
    def steps_per_epoch(self) -> int:
        return max(1, self.dataset_size // max(1, self.train_batch_size))

    @property
    def total_train_steps(self) -> int:
        return self.total_train_epochs * self.steps_per_epoch

    def __post_init__(self) -> None:
        for name in ("total_train_epochs", "dataset_size", "train_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0 or (isinstance(value, float) and math.isnan(value)):
                raise ValueError(f"FinetuneSpec.{name} must be a non-negative int, got {value!r}")
