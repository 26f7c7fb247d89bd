"""The small records passed between workflows, the rollout engine and the trainer (AReaL's names).

Design decisions
- Requests and responses are token-in/token-out. A multi-turn workflow appends the returned `output_tokens` to its
  context and never re-tokenizes text the model generated, so what is trained on is exactly what was sampled.
- Every output token carries the policy version that produced it (`output_versions`): a request interrupted by a
  weight update resumes with the new weights, and its tokens then span two versions.
- The records keep AReaL 1.0.4's fields, order and defaults, so a cell that builds one moves to AReaL unchanged;
  kit extras come after them.
- Weight updates go through disk by default: the trainer writes version k to `weight_update_v<k>` (a temporary
  folder renamed into place, so a reader never sees half a checkpoint) and the servers load that folder.
"""

from __future__ import annotations

import copy
import getpass
import math
import os
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from areal_lite.api.cli_args import GenerationHyperparameters

__all__ = ["ModelRequest", "ModelResponse", "WeightUpdateMeta", "FinetuneSpec", "weight_dir", "get_versioned_lora_name"]


@dataclass
class ModelRequest:
    """One generation request: a prompt as token ids and how to sample it (AReaL 1.0.4's fields, in its order).

    `tokenizer` lets the response strip stop tokens (`output_tokens_without_stop`); the image/processor fields are
    AReaL's vision inputs, accepted and ignored by the kit's text-only servers. `text` is a kit extra.
    """

    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    input_ids: List[int] = field(default_factory=list)
    gconfig: GenerationHyperparameters = field(default_factory=GenerationHyperparameters)
    metadata: Dict[str, Any] = field(default_factory=dict)
    tokenizer: Any = None
    image_data: Optional[List[str]] = field(default_factory=list)
    processor: Any = None
    vision_msg_vllm: Optional[list] = None
    text: Optional[str] = None

    def copy(self) -> "ModelRequest":
        return ModelRequest(
            rid=self.rid,
            input_ids=list(self.input_ids),
            gconfig=self.gconfig.new(),
            metadata=dict(self.metadata),
            tokenizer=self.tokenizer,
            image_data=list(self.image_data) if self.image_data is not None else None,
            processor=self.processor,
            vision_msg_vllm=list(self.vision_msg_vllm) if self.vision_msg_vllm is not None else None,
            text=self.text,
        )


@dataclass
class ModelResponse:
    """What came back: the prompt, the new tokens with their logprobs and versions, and why it stopped.

    AReaL 1.0.4's fields in its order (`stop_reason`: "stop" for EOS, a stop token or a stop string; "length";
    "abort"; "tool_calls"); `rid` is a kit extra.
    """

    input_tokens: List[int] = field(default_factory=list)
    output_tokens: List[int] = field(default_factory=list)
    output_logprobs: List[float] = field(default_factory=list)
    output_versions: List[int] = field(default_factory=list)
    stop_reason: str = "stop"
    tokenizer: Any = None
    input_images: list = field(default_factory=list)
    processor: Any = None
    latency: float = float("inf")
    ttft: float = float("inf")  # time to first token
    itl: List[float] = field(default_factory=list)  # inter-token latencies
    routed_experts: Any = None
    rid: str = ""

    @property
    def input_len(self) -> int:
        return len(self.input_tokens)

    @property
    def output_len(self) -> int:
        return len(self.output_tokens)

    def _stop_ids(self) -> set:
        if self.tokenizer is None:
            raise ValueError("this response has no tokenizer: pass ModelRequest(tokenizer=...) to know its stop tokens")
        return {t for t in (self.tokenizer.eos_token_id, self.tokenizer.pad_token_id) if t is not None}

    @property
    def end_with_stop(self) -> bool:
        """Whether the output ends with the tokenizer's EOS or pad token."""
        return bool(self.output_tokens) and self.output_tokens[-1] in self._stop_ids()

    @property
    def output_tokens_without_stop(self) -> List[int]:
        """The output without its trailing EOS/pad tokens (unchanged when cut by length or aborted)."""
        stop = self._stop_ids()
        if self.stop_reason in ("length", "abort") or not self.output_tokens:
            return list(self.output_tokens)
        n = len(self.output_tokens)
        while n > 0 and self.output_tokens[n - 1] in stop:
            n -= 1
        if n == 0:
            raise ValueError("every output token is EOS or pad: stripping them would leave nothing")
        return list(self.output_tokens[:n])


def get_versioned_lora_name(lora_name: str, version: int) -> str:
    """The name of a LoRA adapter's version `version` on the servers, e.g. 'lora-v1' (AReaL's naming)."""
    return f"{lora_name}-v{version}"


def weight_dir(root: str, version: int) -> str:
    """Where the weights of policy version `version` live under a weight-update folder (AReaL's naming)."""
    return os.path.join(root, f"weight_update_v{int(version)}")


@dataclass
class WeightUpdateMeta:
    """How new weights travel from the trainer to the inference servers (AReaL 1.0.4's fields, then the kit's).

    Disk: version k is written to `dir_for(k)`. As in AReaL, `with_version(k)` returns a copy whose `path` is that
    version's own folder, `<dirname(path)>/weight_update_v<k>`; the kit's engine and actor also take an unversioned
    meta and use `dir_for(get_version() + 1)`. The trainer writes a temporary folder and renames it into place, so a
    reader never sees half a checkpoint, and deletes versions older than `keep_last`.
    "xccl" (AReaL's name) and "nccl" both mean a GPU broadcast; the NCCL fields at the end are filled by
    `FSDPPPOActor.prepare_nccl_meta`.
    """

    type: str
    path: Optional[str] = None
    gen_allocation: Any = None
    nccl_master_address: Optional[str] = None
    nccl_master_port: Optional[int] = None
    nccl_group_name: Optional[str] = None
    weight_chunked_mem_mb: int = 1024
    use_lora: bool = False
    lora_name: str = ""
    lora_int_id: int = 0
    base_model_name: str = ""
    peft_config: dict = field(default_factory=dict)
    lora_keep_versions: int = 0
    clear_checkpoint_after_load: bool = True
    version: Optional[int] = None
    # kit extras
    keep_last: int = 1  # disk: versions the writer keeps (k + 1 is written once the servers loaded k: one is enough)
    names: List[str] = field(default_factory=list)  # NCCL: parameter names, dtypes and shapes in broadcast order
    dtypes: List[str] = field(default_factory=list)
    shapes: List[List[int]] = field(default_factory=list)
    nccl_world_size: int = 0  # NCCL: 1 trainer + the servers' GPUs

    def __post_init__(self) -> None:
        if self.type not in ("disk", "xccl", "nccl"):
            raise ValueError(f"WeightUpdateMeta.type must be 'disk', 'xccl' or 'nccl', got {self.type!r}")

    @property
    def is_broadcast(self) -> bool:
        return self.type in ("xccl", "nccl")

    @classmethod
    def from_disk(
        cls,
        experiment_name: Optional[str] = None,
        trial_name: Optional[str] = None,
        file_root: Optional[str] = None,
        name: str = "default",
        use_lora: bool = False,
        clear_checkpoint_after_load: bool = True,
        lora_name: str = "",
        lora_int_id: int = 1,
        base_model_name: str = "",
        lora_keep_versions: int = 0,
        *,
        path: Optional[str] = None,
        keep_last: int = 1,
    ) -> "WeightUpdateMeta":
        """Versions go to `<folder>/weight_update_v<k>`; AReaL 1.0.4's signature, plus the kit's folder keyword.

        As in AReaL, the folder is `<file_root>/checkpoints/<user>/<experiment_name>/<trial_name>/<name>/weight_update`
        (created). The kit's `path=` keyword names the parent folder directly (put it on /dev/shm when it exists:
        RAM) and `keep_last` how many versions the writer keeps. With `use_lora` versions hold the adapter alone,
        loaded as `<lora_name>-v<k>`.
        """
        if path is None:
            if None in (experiment_name, trial_name, file_root):
                raise TypeError(
                    "WeightUpdateMeta.from_disk takes AReaL's (experiment_name, trial_name, file_root) or the kit's "
                    f"folder keyword path=...; got experiment_name={experiment_name!r}, trial_name={trial_name!r}, "
                    f"file_root={file_root!r}"
                )
            user = getpass.getuser()
            path = os.path.join(file_root, "checkpoints", user, experiment_name, trial_name, name)
            os.makedirs(path, exist_ok=True)
        return cls(
            type="disk",
            path=os.path.join(os.path.abspath(path), "weight_update"),
            keep_last=keep_last,
            use_lora=use_lora,
            clear_checkpoint_after_load=clear_checkpoint_after_load,
            lora_name=lora_name,
            lora_int_id=lora_int_id,
            base_model_name=base_model_name,
            lora_keep_versions=lora_keep_versions,
        )

    @classmethod
    def from_fsdp_xccl(
        cls,
        gen_allocation: Any,
        weight_chunked_mem_mb: int = 1024,
        use_lora: bool = False,
        lora_name: str = "",
        lora_int_id: int = 1,
        base_model_name: str = "",
    ) -> "WeightUpdateMeta":
        """AReaL's GPU broadcast from an FSDP trainer (NCCL, filled in by `FSDPPPOActor.connect_engine`)."""
        return cls(
            type="xccl",
            gen_allocation=gen_allocation,
            weight_chunked_mem_mb=weight_chunked_mem_mb,
            use_lora=use_lora,
            lora_name=lora_name,
            lora_int_id=lora_int_id,
            base_model_name=base_model_name,
        )

    @classmethod
    def from_nccl(cls, master_address: str, master_port: int, group_name: str = "areal_lite_weights"):
        """Weights are broadcast from trainer rank 0 to the SGLang servers over NCCL (GPU only)."""
        return cls(
            type="xccl",
            nccl_master_address=master_address,
            nccl_master_port=int(master_port),
            nccl_group_name=group_name,
        )

    def with_version(self, version: int) -> "WeightUpdateMeta":
        """A copy for version `version`: its path is `<dirname(path)>/weight_update_v<version>` (AReaL's rule)."""
        if version < 0:
            raise ValueError(f"version must be non-negative, got {version}")
        new = copy.copy(self)
        new.version = int(version)
        if self.path is not None:
            new.path = weight_dir(os.path.dirname(self.path), version)
        return new

    def dir_for(self, version: int) -> str:
        """The folder of version `version` in a disk update (this meta's own path once `with_version` was used)."""
        if self.type != "disk" or not self.path:
            raise ValueError("dir_for() is only meaningful for a disk weight update with a path")
        if self.version is not None:
            if int(version) != self.version:
                raise ValueError(f"this meta is for version {self.version}, not {version}")
            return self.path
        return self.with_version(version).path


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


@dataclass
class RolloutStat:
    """Rollout counters of the staleness manager (AReaL's fields)."""

    accepted: int = 0
    enqueued: int = 0
    rejected: int = 0
    running: int = 0
