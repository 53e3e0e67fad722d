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


def piece_sq_sum(grad_piece: torch.Tensor, bucket: Bucket, scale: float) -> torch.Tensor:
    """Sum of squares of ``scale * grad`` over the counted segments of this rank's piece, in fp64.

    fp64 because the sum runs over up to billions of squares split differently per layout:
    an fp32 dot product's rounding (~5e-6 relative in the norm of a 1M-parameter model) was
    larger than every difference between layouts, so the norm would depend on the layout."""
    total = torch.zeros((), dtype=torch.float64, device=grad_piece.device)
    if bucket.segments and all(seg.slot.norm_counted for seg in bucket.segments):
        # Padding is zero, so the whole piece can be summed at once; at scale 1 (no loss scaling)
        # an fp32 piece is squared as it is (no scaled copy: one pass fewer over the gradients).
        g = grad_piece if scale == 1.0 and grad_piece.dtype == torch.float32 else grad_piece.float() * scale
        return total + torch.square(g).sum(dtype=torch.float64)
    for seg in bucket.segments:
        if seg.slot.norm_counted:
            lo = seg.shard_start - bucket.shard_offset
            g = grad_piece[lo : lo + seg.length].float() * scale
            total += torch.square(g).sum(dtype=torch.float64)
    return total


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
