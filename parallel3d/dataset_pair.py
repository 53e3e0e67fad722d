"""The job's training and validation ``GPTDataset``s from their blends, and whether each holds one global batch.

Invariant: the ranks (``datasets.build_datasets``) and preflight (``preflight.check_one_global_batch``, before any
process group) build the pair here, from the same blends and options, so both judge the same sample counts by the
one rule of ``short_of_a_batch``.
"""

from __future__ import annotations

from typing import Sequence

from parallel3d.data import GPTDataset

Blend = tuple[Sequence[str], Sequence[float] | None]  # (prefixes, weights or None)


def dataset_pair(train_blend: Blend, valid_blend: Blend, *, valid_fraction: float, seq_len: int, seed: int,
                 vocab_size: int | None) -> tuple[GPTDataset, GPTDataset | None]:
    """``(train, valid or None)``: with ``valid_fraction > 0`` the held-out tail of the training blend, else the
    separate validation blend (None when it names no prefix). ``vocab_size``: checks the token ids (None: not)."""
    (paths, weights), (valid_paths, valid_weights) = train_blend, valid_blend
    common = dict(seq_len=seq_len, seed=seed, model_vocab_size=vocab_size)
    if valid_fraction > 0:
        return (GPTDataset(paths, weights, split="train", valid_fraction=valid_fraction, **common),
                GPTDataset(paths, weights, split="valid", valid_fraction=valid_fraction, **common))
    return (GPTDataset(paths, weights, **common),
            GPTDataset(valid_paths, valid_weights, **common) if valid_paths else None)


def short_of_a_batch(train: GPTDataset, valid: GPTDataset | None, global_batch_size: int) -> str | None:
    """Which set holds fewer samples than one global batch (training first), said for an error line; else None."""
    for name, dataset in (("training", train), ("validation", valid)):
        if dataset is not None and dataset.samples_per_epoch < global_batch_size:
            return (f"{name} data {[ds.prefix for ds in dataset.datasets]} has {dataset.samples_per_epoch} samples "
                    f"of seq_len={dataset.seq_len}: fewer than one global batch")
    return None
