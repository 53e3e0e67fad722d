"""Zero-bubble pipeline schedules (Qi et al., "Zero Bubble Pipeline Parallelism", 2023).

A backward is split into ``B`` (the input gradient, which the previous stage waits
for) and ``W`` (the weight gradients, which nobody waits for; see
``backward_split``). ``zb_h1`` is 1F1B's order of ``F`` and ``B`` with the ``W``s
placed so that no stage holds more microbatches than 1F1B's first stage does
(``p``: a microbatch is held from its ``F`` until its ``W``), i.e. 1F1B's peak
activation memory:

- stage ``s`` runs 1F1B's ``p - 1 - s`` warm-up forwards, then steady ``F B``
  pairs, then the cool-down ``B``s;
- its ``W``s trail its ``B``s by ``s`` microbatches in the steady state (one ``W``
  after each pair once ``s`` ``B``s are done: ``p - 1 - s`` warm-up + 1 + ``s``
  = ``p`` in flight at most), one ``W`` after each cool-down ``B``, and the rest
  at the end.

So the ``B`` chain of the cool-down runs upstream at the cost of ``B`` alone while
the later stages' deferred ``W``s fill what 1F1B leaves idle: with ``F = B = W``
the bubble is ``(p-1)/(3m+p-1)`` against 1F1B's ``3(p-1)/(3m+3(p-1))``
(p=4, m=8: 0.111 vs 0.273). Correctness (each action once, receives before use,
no deadlock, also under NCCL batches) is checked by ``schedules.validate_schedule``
like every other schedule. ``zbv`` (the V-shaped two-chunk form) is not built.
"""

from __future__ import annotations

Compute = tuple[str, int, int]  # (kind, microbatch, chunk)

__all__ = ["zb_h1_order"]


def zb_h1_order(stage: int, p: int, m: int) -> list[Compute]:
    """Stage ``stage``'s ZB-H1 computation order for ``p`` stages and ``m`` microbatches."""
    warmup = min(p - 1 - stage, m)
    order: list[Compute] = [("F", i, 0) for i in range(warmup)]
    next_w = 0
    for j in range(m - warmup):  # steady state: F, B, and the W that trails by `stage` microbatches
        order += [("F", warmup + j, 0), ("B", j, 0)]
        if j >= stage:
            order.append(("W", next_w, 0))
            next_w += 1
    for j in range(m - warmup, m):  # cool-down: each B, then one deferred W while the next B is on its way
        order.append(("B", j, 0))
        if next_w <= j:
            order.append(("W", next_w, 0))
            next_w += 1
    order += [("W", i, 0) for i in range(next_w, m)]
    return order
