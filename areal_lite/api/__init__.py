"""The kit's API layer, as AReaL 1.0.4's `areal.api`: configuration dataclasses (`cli_args`) and their strict YAML
loader (`config_loader`), the records passed between workflows, engine and trainer (`io_struct`), the workflow base
class (`workflow_api`), the process-pool reward wrapper (`reward_api`), the engine contracts (`engine_api`), and
AReaL's config sections the kit accepts without machinery for them (`areal_only`). Each module defines the AReaL
names of AReaL's module of the same path, so `from areal_lite.api.cli_args import GRPOConfig` becomes
`from areal.api.cli_args import GRPOConfig`.
"""

from __future__ import annotations

from areal_lite.utils.lazy import lazy_exports

# AReaL's `areal.api` re-exports these lazily, so `from areal_lite.api import ModelRequest` converts too.
_LAZY_IMPORTS = {
    "RolloutWorkflow": "areal_lite.api.workflow_api",
    "AsyncRewardWrapper": "areal_lite.api.reward_api",
    "TrainEngine": "areal_lite.api.engine_api",
    "InferenceEngine": "areal_lite.api.engine_api",
    "ModelRequest": "areal_lite.api.io_struct",
    "ModelResponse": "areal_lite.api.io_struct",
    "WeightUpdateMeta": "areal_lite.api.io_struct",
    "FinetuneSpec": "areal_lite.api.io_struct",
    "RolloutStat": "areal_lite.api.io_struct",
}

__all__ = sorted(_LAZY_IMPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY_IMPORTS)
