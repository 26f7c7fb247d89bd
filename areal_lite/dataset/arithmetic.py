"""Easy arithmetic in GSM8K's format: a task a 135M model learns on a laptop in minutes."""

from __future__ import annotations

import random
from collections.abc import Sequence

from areal_lite.dataset.common import _check_split, _from_rows, _stable_hash

__all__ = ["arithmetic_problems", "load_arithmetic", "load_products"]


_OPS = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y}


def arithmetic_problems(
    max_operand: int = 9, ops: Sequence[str] = ("+",), min_operand: int = 0
) -> list[tuple[int, str, int]]:
    """The whole finite problem space (x op y) with min_operand <= x, y <= max_operand; subtraction keeps x >= y."""
    unknown = [op for op in ops if op not in _OPS]
    if unknown or not ops:
        raise ValueError(f"unsupported ops {unknown or ops}; choose from {sorted(_OPS)}")
    if not 0 <= min_operand <= max_operand:
        raise ValueError(f"need 0 <= min_operand <= max_operand, got {min_operand} and {max_operand}")
    return [
        (x, op, y)
        for op in ops
        for x in range(min_operand, max_operand + 1)
        for y in range(min_operand, max_operand + 1)
        if not (op == "-" and x < y)
    ]


def load_arithmetic(
    split: str = "train",
    size: int | None = None,
    seed: int = 0,
    max_operand: int = 9,
    ops: Sequence[str] = ("+",),
    test_fraction: float = 0.25,
    min_operand: int = 0,
):
    """Problems like "What is 3 + 5?" with answer "3 + 5 = 8\\n#### 8", as a `datasets.Dataset`.

    The finite space is split once by a fixed hash ordering (`test_fraction` of it is test), so train and test
    never share a problem whatever the seeds. `seed` shuffles the split; size=None returns the whole split; a
    larger `size` repeats the split in freshly shuffled passes (the space is small: 100 problems for x+y, 0-9).
    `load_products` is the two-digit multiplication a 135M model cannot do unaided (notebook 09's tool task).
    """
    split = _check_split(split)
    space = arithmetic_problems(max_operand, tuple(ops), min_operand)
    space.sort(key=lambda p: _stable_hash(f"arith:{p[0]}{p[1]}{p[2]}"))
    n_test = max(1, round(len(space) * test_fraction)) if len(space) > 1 else 0
    pool = space[:n_test] if split == "test" else space[n_test:]
    if not pool:
        raise ValueError(f"the {split} split is empty (space of {len(space)} problems, test_fraction={test_fraction})")
    size = len(pool) if size is None else size
    if size <= 0:
        raise ValueError(f"size must be positive, got {size}")
    rng = random.Random(seed)
    chosen: list[tuple[int, str, int]] = []
    while len(chosen) < size:
        order = pool[:]
        rng.shuffle(order)
        chosen.extend(order[: size - len(chosen)])
    rows = []
    for x, op, y in chosen:
        result = _OPS[op](x, y)
        rows.append({"question": f"What is {x} {op} {y}?", "answer": f"{x} {op} {y} = {result}\n#### {result}"})
    return _from_rows(rows)


def load_products(split: str = "train", size: int | None = None, seed: int = 0):
    """ "What is 37 * 48?": both factors 10-99 (8100 problems, a quarter held out), answers in GSM8K's format."""
    return load_arithmetic(split=split, size=size, seed=seed, max_operand=99, ops=("*",), min_operand=10)
