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


# Elements squared per fp64 dot product in ``sq_sum_fp64``: a 2 MiB fp64 chunk stays in cache on a CPU,
# and it bounds the norm's temporaries (``planning.memory`` counts them from this constant).
SQ_SUM_CHUNK = 1 << 18


def sq_sum_fp64(values: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Sum of squares of ``scale * values`` (1-D) in fp64, one chunk at a time.

    Each chunk's ``scale * values`` is rounded to fp32 (the gradient the update reads; no pass
    and no copy for an fp32 chunk at scale 1), cast to fp64 and dotted with itself: the squares
    of fp32 values are exact in fp64 (48 significant bits), so only the fp64 additions round.
    Faster on a CPU than ``torch.square(g).sum(dtype=torch.float64)`` (which rounded each square
    to fp32 and upcast it element by element through an fp64 copy of the whole piece: about 2x
    the time and 12 bytes per element held) and more exact; the temporaries are one chunk's."""
    total = torch.zeros((), dtype=torch.float64, device=values.device)
    for chunk in values.split(SQ_SUM_CHUNK):
        if scale != 1.0 or chunk.dtype != torch.float32:
            chunk = chunk.float() * scale
        wide = chunk.double()
        total += torch.dot(wide, wide)
    return total


def piece_sq_sum(grad_piece: torch.Tensor, bucket: Bucket, scale: float) -> torch.Tensor:
    """Sum of squares of ``scale * grad`` over the counted segments of this rank's piece, in fp64.

    fp64 because the sum runs over up to billions of squares split differently per layout:
    an fp32 dot product's rounding (~5e-6 relative in the norm of a 1M-parameter model) was
    larger than every difference between layouts, so the norm would depend on the layout."""
    if bucket.segments and all(seg.slot.norm_counted for seg in bucket.segments):
        return sq_sum_fp64(grad_piece, scale)  # padding is zero: the whole piece at once
    total = torch.zeros((), dtype=torch.float64, device=grad_piece.device)
    for seg in bucket.segments:
        if seg.slot.norm_counted:
            lo = seg.shard_start - bucket.shard_offset
            total += sq_sum_fp64(grad_piece[lo : lo + seg.length], scale)
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
