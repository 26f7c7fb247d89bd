"""The leading tokens several prompts share: what the trainer's packing and the server's fast path both compute once.

It lives here, below both, so the inference server imports nothing of the trainer (`engine/`): the two processes
share this rule, not each other's code.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["common_start"]


def common_start(prompts: Sequence[Sequence[int]], min_saved: int) -> int:
    """How many leading tokens every one of several distinct `prompts` shares, leaving each at least one of its
    own; 0 when sharing them would save fewer than `min_saved` tokens (an extra attention call is not free)."""
    if len(prompts) < 2:
        return 0
    c = min(len(p) for p in prompts) - 1
    first = prompts[0]
    for p in prompts[1:]:
        c = next((i for i in range(c) if p[i] != first[i]), c)
    return c if c * (len(prompts) - 1) >= min_saved else 0
