"""What the rank pools save: a fresh rank already holds what a step imports lazily, and the pools kept warm are
the most recently used world sizes (``tests/harness.py``).

Reference for the first: ``sys.modules`` of a brand-new pool's ranks before any task ran there, against the
modules a rank's first training step would otherwise import (each ~1 s of CPU per fresh rank). For the second:
the pools' identities (``id``) across calls, read from the harness's cache.
"""

from __future__ import annotations

import sys

from tests import harness

# What a rank's first step imports lazily (torch.utils.checkpoint -> torch._dynamo; the AdamW and cross-entropy
# kernels -> triton; the corpus's tokenizer): each must come from the fork server, not from each rank.
LAZY = ("torch._dynamo", "torch._inductor", "triton", "kernels.adamw", "kernels.cross_entropy", "tokenizers")


def modules_held(rank: int, world: int, names: tuple[str, ...]) -> list[str]:
    return [n for n in names if n in sys.modules]


def test_a_fresh_rank_inherits_what_a_first_step_imports():
    pool = harness.RankPool(2)
    try:
        held = pool.run(modules_held, (LAZY,), {}, timeout=60)
    finally:
        pool.close()
    assert held == [list(LAZY)] * 2, held


def _rank(rank: int, world: int) -> int:
    return rank


def test_the_pools_kept_are_the_most_recently_used_world_sizes():
    harness._shutdown_pools()
    n = harness.WARM_WORLD_SIZES
    try:
        for world in range(1, n + 1):
            harness.run_on_ranks(_rank, world, timeout=60)
        first = harness._POOLS[1]
        assert harness.run_on_ranks(_rank, 1, timeout=60) == [0]  # 1 is now the most recent, 2 the least
        harness.run_on_ranks(_rank, n + 1, timeout=60)
        assert list(harness._POOLS) == [*range(3, n + 1), 1, n + 1]  # 2 went, 1 stayed
        assert harness._POOLS[1] is first  # reused, not started again
    finally:
        harness._shutdown_pools()
