"""The dataset a config's `DatasetConfig` names: `type` ("gsm8k", "arith", "products" or "factbook_qa"), with `path`,
`split`, `size`, `seed`. AReaL's configs give `type` the training method (`rl`) and name the data by `path`
(`openai/gsm8k`); then the data's name is read from the path, and a path the kit cannot name is an error.
"""

from __future__ import annotations

from areal_lite.dataset.arithmetic import load_arithmetic, load_products
from areal_lite.dataset.common import _subset, load_json_dataset
from areal_lite.dataset.factbook import load_search_dataset
from areal_lite.dataset.gsm8k import load_gsm8k

__all__ = ["load_dataset_from_config"]

_AREAL_METHODS = ("rl", "sft", "rw", "dpo")  # AReaL's `type` values: how the data is used, not which data


def _kind_of_path(path: str, method: str) -> str:
    if "gsm8k" in path.lower():
        return "gsm8k"
    raise ValueError(
        f"dataset type={method!r} (AReaL's training method) with path={path!r}: the kit reads GSM8K by path "
        "(e.g. openai/gsm8k); for other data set type to one of 'gsm8k', 'arith', 'products', 'factbook_qa'"
    )


def load_dataset_from_config(dataset_config):
    """Dispatch on `type` ("gsm8k" | "arith" | "products" | "factbook_qa") using `path`, `split`, `size`, `seed`."""
    kind = getattr(dataset_config, "type", "gsm8k")
    if kind in _AREAL_METHODS:
        kind = _kind_of_path(getattr(dataset_config, "path", None) or "", kind)
    path = getattr(dataset_config, "path", None) or None
    split = getattr(dataset_config, "split", "train") or "train"
    size = getattr(dataset_config, "size", None)
    seed = getattr(dataset_config, "seed", 0) or 0
    if kind == "gsm8k":
        return load_gsm8k(split=split, path=path, size=size, seed=seed)
    if kind in ("arith", "arithmetic"):
        if path is not None:
            return _subset(load_json_dataset(path, split), size, seed)
        return load_arithmetic(split=split, size=size, seed=seed)
    if kind == "products":
        if path is not None:
            return _subset(load_json_dataset(path, split), size, seed)
        return load_products(split=split, size=size, seed=seed)
    if kind in ("factbook_qa", "factbook", "search"):
        return load_search_dataset(path=path, split=split, size=size, seed=seed)
    raise ValueError(f"unknown dataset type {kind!r}; use 'gsm8k', 'arith', 'products' or 'factbook_qa'")
