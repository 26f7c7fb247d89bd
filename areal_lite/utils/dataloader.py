"""Dataloaders, beside AReaL 1.0.4's `areal.utils.dataloader`.

Design decision: `make_dataloader` returns a `StatefulDataLoader` whose batches are lists of row dicts (a named,
picklable collate function, since a lambda cannot cross to a worker process or into a checkpoint) and whose shuffle
uses its own seeded generator, so `state_dict()`/`load_state_dict()` resumes at the same position.
"""

from __future__ import annotations

import warnings

__all__ = ["collate_rows", "make_dataloader"]


def collate_rows(rows: list[dict]) -> list[dict]:
    """Keep a batch as a list of row dicts (named, so the dataloader stays picklable)."""
    return list(rows)


def make_dataloader(dataset, batch_size: int, shuffle: bool = True, seed: int = 0, drop_last: bool = True):
    """`StatefulDataLoader` yielding lists of row dicts, seeded shuffle, resumable with state_dict()."""
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import RandomSampler

    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if drop_last and len(dataset) < batch_size:
        raise ValueError(f"dataset has {len(dataset)} rows, fewer than batch_size={batch_size} with drop_last=True")
    # Two generators: the sampler's drives the shuffle; the loader's only feeds the per-epoch base seed it draws
    # for workers. Sharing one makes a resumed run's *later* epochs differ from an uninterrupted run, and with
    # no generator at all the loader would draw from (and perturb) the global torch RNG.
    loader_generator = torch.Generator()
    loader_generator.manual_seed(seed + 1)
    sampler = None
    if shuffle:
        sampler_generator = torch.Generator()
        sampler_generator.manual_seed(seed)
        sampler = RandomSampler(dataset, generator=sampler_generator)
    with warnings.catch_warnings():
        # torchdata calls a deprecated torch telemetry hook in its constructor; the warning says nothing to a user
        warnings.filterwarnings("ignore", message=".*set_vital.* is deprecated")
        return StatefulDataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            drop_last=drop_last,
            collate_fn=collate_rows,
            generator=loader_generator,
            num_workers=0,
        )
