"""What every dataset shares: the data folder, the train/test rule, atomic JSONL writes, local JSON
files, chat messages.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
from collections.abc import Iterable

from areal_lite.utils.atomic import atomic_file
from areal_lite.utils.model_store import cache_root

__all__ = ["DATA_VERSION", "SPLITS", "data_dir", "load_json_dataset", "to_messages"]


DATA_VERSION = 2


SPLITS = ("train", "test")


def data_dir() -> str:
    """Folder for generated data files: `<cache root>/data`."""
    return os.path.join(cache_root(), "data")


def _stable_hash(text: str) -> int:
    # Python's hash() is salted per process; sha1 is the same everywhere.
    return int.from_bytes(hashlib.sha1(text.encode("utf-8")).digest()[:8], "big")


def _is_test(key: str, test_fraction: float) -> bool:
    return _stable_hash("split:" + key) % 10_000 < int(test_fraction * 10_000)


def _check_split(split: str) -> str:
    if split in ("validation", "valid", "eval"):
        split = "test"
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {SPLITS}")
    return split


def _write_jsonl_atomic(path: str, rows: Iterable[dict]) -> str:
    """Write rows to `path` once: temp file + rename under a lock. Returns `path`."""
    from filelock import FileLock

    path = os.path.abspath(path)
    if os.path.exists(path):
        return path
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    with FileLock(path + ".lock"):
        if os.path.exists(path):
            return path  # another process finished it while we waited

        def fill(tmp: str) -> None:
            with open(tmp, "w", encoding="utf-8") as f:
                for row in rows:
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")

        atomic_file(path, fill, suffix=".jsonl")
    return path


def _from_rows(rows: list[dict]):
    import datasets

    if not rows:
        raise ValueError("no rows to build a dataset from")
    return datasets.Dataset.from_list(rows)


def _subset(ds, size: int | None, seed: int):
    """Seeded random subset of `size` rows (all rows, in file order, when size is None)."""
    if size is None:
        return ds
    if size <= 0:
        raise ValueError(f"size must be positive, got {size}")
    if size > len(ds):
        raise ValueError(f"asked for {size} rows but the dataset has only {len(ds)}")
    return ds.shuffle(seed=seed).select(range(size))


def _looks_like_local_path(path: str) -> bool:
    """A missing file like "data/train.jsonl" must fail loudly, not be sent to the hub as a repo id."""
    if path.endswith((".json", ".jsonl")) or path.startswith(("/", ".", "~")):
        return True
    return not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", path)


def load_json_dataset(path: str, split: str = "train"):
    """Load a local JSON/JSONL file, or a folder of them, with `datasets.load_dataset("json", ...)`.

    In a folder, `<split>.jsonl` / `<split>.json` is used when present, otherwise every JSON/JSONL file.
    """
    import datasets

    path = os.path.expanduser(path)
    if os.path.isdir(path):
        files = [os.path.join(path, f"{split}{ext}") for ext in (".jsonl", ".json")]
        files = [f for f in files if os.path.exists(f)]
        if not files:
            files = sorted(glob.glob(os.path.join(path, "*.jsonl")) + glob.glob(os.path.join(path, "*.json")))
        if not files:
            raise FileNotFoundError(f"no .json/.jsonl files in {path}")
    elif os.path.isfile(path):
        files = [path]
    else:
        raise FileNotFoundError(f"dataset file not found: {path}")
    return datasets.load_dataset("json", data_files=files, split="train")


def to_messages(row: dict, system_prompt: str | None = None) -> dict:
    """Row -> same row plus `messages` = [system?, user(question)], ready for `apply_chat_template`."""
    if "question" not in row:
        raise KeyError(f"row has no 'question' key (keys: {sorted(row)})")
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": row["question"]})
    return {**row, "messages": messages}
