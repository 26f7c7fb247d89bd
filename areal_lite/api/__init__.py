"""The kit's API layer, as AReaL 1.0.4's `areal.api`: configuration dataclasses and their loader (`cli_args`), the
records passed between workflows, engine and trainer (`io_struct`), the workflow base class (`workflow_api`) and the
process-pool reward wrapper (`reward_api`). Each module defines the AReaL names of AReaL's module of the same path,
so `from areal_lite.api.cli_args import GRPOConfig` becomes `from areal.api.cli_args import GRPOConfig`.
"""

from __future__ import annotations

import importlib
from typing import Any

# AReaL's `areal.api` re-exports these lazily (PEP 562), so `from areal_lite.api import RolloutWorkflow` converts too.
_LAZY_IMPORTS = {
    "RolloutWorkflow": "areal_lite.api.workflow_api",
    "AsyncRewardWrapper": "areal_lite.api.reward_api",
}

__all__ = sorted(_LAZY_IMPORTS)


def __getattr__(name: str) -> Any:
    if name in _LAZY_IMPORTS:
        value = getattr(importlib.import_module(_LAZY_IMPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(__all__)
