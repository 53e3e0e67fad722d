"""Global gradient norm over the whole job, counting every logical parameter once.

Each rank sums squares over the elements it owns (its shard of each layout for
stages 1-3, everything for stage 0) of the parameters it counts: tensor-parallel-split
parameters on every TP rank, TP-replicated ones (norms, row-parallel biases)
only on TP rank 0, routed experts (replicated over ``edp``) on every rank, the tied embedding only in its embedding's copy. Per
replica group (``BufferLayout.reduce_kind``, dense: ``dp_cp``) the sum is then
all-reduced over that group (only when shards differ, stages 1-3) and over its
complement (``topology.complement``: ``model`` = tp x pp for ``dp_cp``), so every
rank of the job ends with the same norm.
"""

from __future__ import annotations

import math

import torch

from parallel3d import comm, param_meta
from parallel3d.parallel_state import ParallelState
from parallel3d.topology import complement
from parallel3d.zero.buffers import Bucket


def counts_in_norm(param: torch.Tensor, pstate: ParallelState) -> bool:
    """Whether this rank contributes ``param`` to the global norm."""
    if param_meta.is_expert_param(param):  # every etp x ep rank holds a different piece of the experts
        return True
    if not param_meta.is_tp_split(param) and pstate.coord("tp") != 0:
        return False
    if param_meta.is_tied_head_copy(param):
        return False
    return True


# Elements per row of the sum of squares (``piece_sq_sum``): each row is summed in fp32, the rows in fp64.
NORM_ROW = 256
# Bytes per gradient element the sum of squares allocates: one fp32 and one fp64 value per row.
SQ_SUM_TEMPORARY_BYTES = (4 + 8) / NORM_ROW


def _sq_sum(g: torch.Tensor) -> torch.Tensor:
    """Sum of squares of the flat tensor ``g`` in fp64: fp32 rows of ``NORM_ROW`` elements, rows added in fp64.

    Why rows: one fp32 reduction over a whole piece (``torch.dot``, ``vector_norm``: a few vector
    accumulators running over ~10^5 terms each) drifts ~1e-4 relative in the norm, which depends on
    how the layout cuts the pieces; squaring into an fp64 copy is exact but costs 12 bytes per element
    and ~10x the time. A row of 256 elements is one short fp32 reduction (its relative rounding is at
    most ~32 ulps, ~2e-6, and averages out over rows: ~4e-8 on 2M elements, against 2e-9 for the fp64
    copy and the layout matrix's 1e-5), and only the row results are kept: ``SQ_SUM_TEMPORARY_BYTES``
    per element. ``tests/test_zero_grad_norm.py`` pins the accuracy and the temporaries."""
    g = g.float() if g.dtype != torch.float32 else g
    whole = g.numel() - g.numel() % NORM_ROW
    total = torch.zeros((), dtype=torch.float64, device=g.device)
    if whole:
        rows = torch.linalg.vector_norm(g[:whole].view(-1, NORM_ROW), dim=1)
        total += torch.square(rows.double()).sum()
    if whole < g.numel():
        total += torch.linalg.vector_norm(g[whole:]).double() ** 2
    return total


def piece_sq_sum(grad_piece: torch.Tensor, bucket: Bucket, scale: float) -> torch.Tensor:
    """Sum of squares of ``scale * grad`` over the counted segments of this rank's piece, in fp64
    (``_sq_sum``). ``scale`` multiplies the sum (by ``scale**2``, exact for the loss scaler's powers
    of two) instead of a scaled copy of the gradients."""
    factor = scale * scale
    if bucket.segments and all(seg.slot.norm_counted for seg in bucket.segments):
        return _sq_sum(grad_piece) * factor  # padding is zero: the whole piece at once
    total = torch.zeros((), dtype=torch.float64, device=grad_piece.device)
    for seg in bucket.segments:
        if seg.slot.norm_counted:
            lo = seg.shard_start - bucket.shard_offset
            total += _sq_sum(grad_piece[lo : lo + seg.length])
    return total * factor


def reduce_norm(local_sq: dict[str, torch.Tensor], pstate: ParallelState, *,
                sharded: bool | dict[str, bool]) -> float:
    """The global L2 norm from this rank's sums of squares per replica group kind (inf/nan propagate).

    ``sharded`` (for every kind, or per kind): the replicas hold different shards (stages 1-3), so
    their sums add up."""
    total = 0.0
    for kind in sorted(local_sq):  # the same order on every rank
        sq = local_sq[kind].reshape(1).clone()
        if sharded if isinstance(sharded, bool) else sharded[kind]:
            comm.all_reduce(sq, pstate, kind)
        comm.all_reduce(sq, pstate, complement(kind))
        total += sq.item()
    return math.sqrt(total) if math.isfinite(total) else total


def clip_coefficient(norm: float, max_norm: float | None) -> float:
    """The factor ``torch.nn.utils.clip_grad_norm_`` would apply (1.0 without clipping)."""
    if max_norm is None:
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))


def uncounted_all_finite(grad_piece: torch.Tensor, bucket: Bucket) -> bool:
    """Whether the elements this rank does not count in the norm are finite (counted ones show in the norm)."""
    for seg in bucket.segments:
        if not seg.slot.norm_counted:
            lo = seg.shard_start - bucket.shard_offset
            if not bool(torch.isfinite(grad_piece[lo : lo + seg.length]).all()):
                return False
    return True
