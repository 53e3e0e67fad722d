"""The job's training and validation datasets, from ``data.*`` (all ranks build the same ones).

- Training: the built-in corpus (``source=default``; global rank 0 builds it, the others
  wait) or the blend of ``data.paths`` / ``data.weights`` / ``data.blend`` (Megatron's
  syntax accepted, see ``data.blend``).
- Validation: the held-out tail of the same datasets (``data.valid_fraction > 0``: the
  training set then reads only the head), or the separate ``data.valid_paths``; None when
  neither. Both are pure functions of the config and the data, so every layout reads the
  same validation samples.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from parallel3d import data, user_warnings
from parallel3d.config import ResolvedJob
from parallel3d.dataset_pair import dataset_pair
from parallel3d.preflight import refuse_short

if TYPE_CHECKING:  # pragma: no cover
    from parallel3d.parallel_state import ParallelState


def build_datasets(rj: ResolvedJob, pstate: "ParallelState") -> tuple[data.GPTDataset, data.GPTDataset | None, Any]:
    """``(train, valid or None, tokenizer or None)`` for this job; see module doc. The tokenizer
    is the one the tokens come from (None for indexed data that names none: ``data.tokenizer_file``)."""
    d, t = rj.data, rj.train
    if d.source == "default":
        prefix, tokenizer = data.build_default_corpus(
            d.cache_dir, vocab_size=rj.model.vocab_size, corpus=d.corpus, tokenizer=d.tokenizer,
            is_builder=pstate.rank == 0, wait_timeout_s=t.timeout_s,
        )
        (paths, weights), (valid_paths, valid_weights) = ([prefix], None), ([], None)
    else:
        (paths, weights), (valid_paths, valid_weights) = rj.data.blends()
        tokenizer = data.indexed_data_tokenizer(d.tokenizer_file, paths)
    train, valid = dataset_pair((paths, weights), (valid_paths, valid_weights), valid_fraction=d.valid_fraction,
                                seq_len=t.seq_len, seed=t.seed, vocab_size=rj.model.vocab_size)
    if valid is not None and d.valid_fraction == 0:
        shared = sorted({os.path.realpath(p) for p in paths} & {os.path.realpath(p) for p in valid_paths})
        if shared and pstate.rank == 0:
            user_warnings.warn(f"data.valid_paths shares {shared} with data.paths: the eval loss is measured on "
                               f"training data (hold out a split with data.valid_fraction, or give other prefixes)")
    # Preflight counted indexed data and a cached built-in corpus; one tokenized here at first use is counted by the
    # same rule (a ConfigError: one line, exit 2).
    refuse_short((train, valid), t.global_batch_size)
    return train, valid, tokenizer
