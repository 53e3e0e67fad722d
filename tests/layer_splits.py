"""Drawn splits of a model's layers over pipeline chunks (the layout generators' uneven ``parallel.pp_layers``).

Invariant: every split sums to the layers it was given, one count per chunk; only the end chunks may be
empty (``pipeline.options.PipelineOptions.check_layout``'s rule, which the validator applies to each draw).
"""

from __future__ import annotations

import random


def composition(rng: random.Random, total: int, parts: int) -> list[int]:
    """A random split of ``total`` layers into ``parts`` positive counts."""
    cuts = sorted(rng.sample(range(1, total), parts - 1))
    return [b - a for a, b in zip([0, *cuts], [*cuts, total])]


def empty_ends(rng: random.Random, counts: list[int]) -> list[int]:
    """``counts`` with, sometimes, the first and/or the last chunk emptied (the embedding alone, the final
    norm and head alone: Llama 3 405B's layout), its layers moved to the neighbouring chunk."""
    out, which = list(counts), rng.choice(("none", "first", "last", "both", "both"))
    if which in ("first", "both") and len(out) >= 2:
        out[1], out[0] = out[1] + out[0], 0
    if which in ("last", "both") and len(out) >= 3:
        out[-2], out[-1] = out[-2] + out[-1], 0
    return out
