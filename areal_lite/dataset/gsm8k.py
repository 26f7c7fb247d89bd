"""GSM8K-format math problems, generated offline from `reasoning_gym`'s GSM-Symbolic templates (or a local file /
the hub's `openai/gsm8k` when a path is given).
"""

from __future__ import annotations

import os
import re
import warnings

from areal_lite.dataset.common import (
    _check_split,
    _from_rows,
    _is_test,
    _looks_like_local_path,
    _subset,
    load_json_dataset,
)

__all__ = ["DEFAULT_GSM_SIZE", "generate_gsm_symbolic", "load_gsm8k"]


_RG_SUFFIX = " Give the result as your final answer. Do not include units."


DEFAULT_GSM_SIZE = {"train": 2000, "test": 500}


def _gsm_row(item: dict) -> dict | None:
    """reasoning_gym item -> GSM8K row, or None when the answer is not an integer (GSM8K answers are)."""
    answer = str(item["answer"]).strip()
    if not re.fullmatch(r"-?\d+", answer):
        return None
    question = item["question"]
    if question.endswith(_RG_SUFFIX):
        question = question[: -len(_RG_SUFFIX)]
    cot = (item.get("metadata") or {}).get("answer_cot") or ""
    m = re.search(r"####\s*(\S+)\s*$", cot)
    if m:
        try:
            if float(m.group(1).replace(",", "")) != float(answer):
                return None  # inconsistent template output; skip rather than teach a wrong answer
        except ValueError:
            return None
        cot = cot[: m.start()].rstrip()
    text = f"{cot}\n#### {answer}" if cot else f"#### {answer}"
    return {"question": question.strip(), "answer": text}


def generate_gsm_symbolic(split: str = "train", size: int | None = None, seed: int = 0, test_fraction: float = 0.2):
    """GSM8K-format problems from reasoning_gym's GSM-Symbolic templates, as a list of row dicts."""
    with warnings.catch_warnings():
        # reasoning_gym imports cellpylib, whose source trips SyntaxWarnings the first time Python compiles it:
        # noise about a third-party file, printed into a learner's notebook
        warnings.simplefilter("ignore", SyntaxWarning)
        import reasoning_gym

    split = _check_split(split)
    size = DEFAULT_GSM_SIZE[split] if size is None else size
    if size <= 0:
        raise ValueError(f"size must be positive, got {size}")
    # reasoning_gym seeds item i with Random(seed + i): spread our seeds far apart so that seed s+1 is not
    # seed s shifted by one item.
    rg_seed = (seed * 1_000_003 + 7919) % (2**31)
    budget = size * 20 + 1000
    ds = reasoning_gym.create_dataset("gsm_symbolic", size=budget, seed=rg_seed)
    rows, seen = [], set()
    for i in range(budget):
        row = _gsm_row(ds[i])
        if row is None or row["question"] in seen:
            continue
        if _is_test(row["question"], test_fraction) != (split == "test"):
            continue
        seen.add(row["question"])
        rows.append(row)
        if len(rows) == size:
            return rows
    raise RuntimeError(f"could only generate {len(rows)} distinct {split} problems (asked for {size})")


def load_gsm8k(split: str = "train", path: str | None = None, size: int | None = None, seed: int = 0):
    """GSM8K rows `{"question", "answer": "... #### N"}` as a `datasets.Dataset`.

    path=None: offline GSM-Symbolic problems (train/test disjoint). A local JSON/JSONL file or folder: loaded as is.
    Anything else (e.g. "openai/gsm8k"): the hub, config "main" for GSM8K. `size` takes a seeded subset.
    """
    if path is None:
        return _from_rows(generate_gsm_symbolic(split, size, seed))
    if os.path.exists(os.path.expanduser(path)):
        return _subset(load_json_dataset(path, split), size, seed)
    if _looks_like_local_path(path):
        raise FileNotFoundError(f"dataset file not found: {path}")
    import datasets

    name = "main" if path.rstrip("/").lower().endswith("gsm8k") else None
    return _subset(datasets.load_dataset(path, name, split=split), size, seed)
