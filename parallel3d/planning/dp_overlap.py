"""How much of a stage's overlapped data-parallel traffic the step exposes, chunk by chunk.

Both runtimes priced here (parallel3d's ``grad_sync.prepare`` on a chunk's last backward, Megatron-Core's
per-chunk ``grad_sync_func`` / ``param_sync_func``) reduce each model chunk's gradients as soon as that
chunk's last backward has produced them, and (with an overlapped parameter all-gather) gather each chunk's
parameters for the next step before that chunk's first forward. With interleaving (``v`` chunks per
stage) the early chunks' reductions therefore run during the later chunks' cool-down backwards, not
after the stage's last one. The collectives of one rank share its link, so they run one after another.

Invariant: with one chunk per stage both functions reduce to the single-chunk rule the cost model used
before, ``max(floor, traffic - one pass)``; every term is a time in seconds, never negative.
"""

from __future__ import annotations

from typing import Sequence


def exposed_reduction(traffic: Sequence[float], grads_done: Sequence[float], last_pass: Sequence[float],
                      stage_end: float, floor: float) -> float:
    """Seconds the gradient reductions run past ``stage_end``.

    ``traffic[c]``: chunk c's reduction time; ``grads_done[c]``: when its last backward ends;
    ``last_pass[c]``: that backward's length, during which its earlier buckets already stream.
    ``floor``: the last bucket, which waits for the stage's last gradient whatever else overlaps."""
    link = 0.0
    for c in sorted(range(len(traffic)), key=lambda i: grads_done[i]):
        if traffic[c] > 0:
            link = max(link, grads_done[c] - last_pass[c]) + traffic[c]
    return max(floor, link - stage_end)


def exposed_gather(traffic: Sequence[float], first_forward: Sequence[float], first_pass: Sequence[float],
                   floor: float) -> float:
    """Seconds the next step's parameter all-gathers delay its forwards.

    They start when the step starts, chunk by chunk in the order the chunks first run forward, one
    after another on the link; chunk c's must end by its first forward (``first_forward[c]``, from the
    stage's start) plus that forward's length (``first_pass[c]``: its later buckets overlap it).
    ``floor``: the first bucket, which nothing hides."""
    link, late, launch = 0.0, 0.0, 0.0
    for c in sorted(range(len(traffic)), key=lambda i: first_forward[i]):
        if traffic[c] > 0:  # a chunk's gather is launched at the previous chunk's first forward
            link = max(link, launch) + traffic[c]
            late = max(late, link - first_forward[c] - first_pass[c])
        launch = first_forward[c]
    return max(floor, late)


def chunk_shares(layers: Sequence[float], ends: Sequence[int], stage_params: float, end_params: float) -> list[float]:
    """Each chunk's fraction of a stage's parameters: its layers' share of what the ends (the embedding on
    the first model chunk, the head on the last; ``ends[c]`` of them on chunk c, ``end_params`` each)
    leave over, plus its ends. Layer counts alone when that leaves nothing (a split the caller invented)."""
    per_layer = max(0.0, stage_params - sum(ends) * end_params) / max(sum(layers), 1e-9)
    weights = [n * per_layer + e * end_params for n, e in zip(layers, ends)]
    total = sum(weights)
    if total <= 0:
        return [1.0 / len(layers)] * len(layers)
    return [w / total for w in weights]
