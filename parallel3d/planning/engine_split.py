"""The pipeline engine's balanced layer split, computed once per (model, depth, chunks, sequence).

Invariant: ``engine_split(config, pp, v, seq_len)`` equals ``partition_layers(config, pp, v,
seq_len=seq_len)`` (as a tuple of ``(first, last_exclusive)`` ranges, so a shared answer cannot be
changed by a caller). Why a cache: a planner search, the published-run completion and the memory and
step prices each ask for the same split many times (profile of ``validation.validate('held_out')``,
session 46: 849 splits, 36 of 189 s, for a few dozen distinct ones), and the split is a pure function
of these four arguments (``ModelConfig`` is frozen). The cache is bounded, so a long process that
plans many models keeps only the recent splits.
"""

from __future__ import annotations

from functools import lru_cache

from models.config import ModelConfig
from parallel3d.pipeline.partition import partition_layers

__all__ = ["engine_split"]

SPLITS_KEPT = 4096  # distinct (model, pp, v, seq_len) splits kept; a whole validation table asks ~100


@lru_cache(maxsize=SPLITS_KEPT)
def engine_split(config: ModelConfig, pp: int, virtual_stages: int = 1,
                 seq_len: int | None = None) -> tuple[tuple[int, int], ...]:
    """``partition_layers(config, pp, virtual_stages, seq_len=seq_len)``, cached (module docstring)."""
    return tuple(partition_layers(config, pp, virtual_stages, seq_len=seq_len))
