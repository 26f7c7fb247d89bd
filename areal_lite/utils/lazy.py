"""Lazy package re-exports (PEP 562), as AReaL's package `__init__`s do them.

`from areal_lite.api import ModelRequest` must work as `from areal.api import ModelRequest` does, without making
`import areal_lite.api` load torch: a package lists `name -> module` and binds `__getattr__`/`__dir__` from here.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Dict, List, Tuple


def lazy_exports(package: str, names: Dict[str, str]) -> Tuple[Callable[[str], Any], Callable[[], List[str]]]:
    """`(__getattr__, __dir__)` for `package`, importing `names[name]` on first access and caching the value."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(names[name]), name)
        setattr(importlib.import_module(package), name, value)
        return value

    def __dir__() -> List[str]:
        return sorted(names)

    return __getattr__, __dir__
