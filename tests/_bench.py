"""Load a bench/ script as a module, so tests can reach its helpers (bench/ is not a package)."""

from __future__ import annotations

import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_bench(name: str):
    """bench/<name>.py, imported under the name `name`. bench/ goes on the import path, as when a script runs, since
    the scripts import their siblings (`_machine`)."""
    bench_dir = os.path.join(ROOT, "bench")
    if bench_dir not in sys.path:
        sys.path.append(bench_dir)
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "bench", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import would: a dataclass in the script looks its module up there
    spec.loader.exec_module(module)
    return module
