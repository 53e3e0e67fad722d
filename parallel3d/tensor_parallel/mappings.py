"""Autograd functions that move activations in and out of the tensor-parallel region.

Named after the Megatron-LM paper's ``f`` and ``g`` operators; each is the
other's transpose, so forward and backward communicate once each:

==============================  ==========================  ===========================
function                        forward                     backward
==============================  ==========================  ===========================
``copy_to_tp_region`` (f)       identity                    all-reduce over tp
``reduce_from_tp_region`` (g)   all-reduce over tp          identity
``gather_last_dim``             all-gather (last dim)       keep own chunk (split)
``split_last_dim``              keep own chunk (split)      all-gather (last dim)
``gather_seq``  (SP)            all-gather along dim 1      reduce-scatter along dim 1
``reduce_scatter_seq`` (SP)     reduce-scatter along dim 1  all-gather along dim 1
``split_seq`` (SP)              keep own chunk of dim 1     all-gather along dim 1
==============================  ==========================  ===========================

Every collective goes through ``parallel3d.comm`` on the ``tp`` group, so a
group of one (tp=1, single process, ``ParallelState.without_groups``) makes all
of them the identity: the model has one code path for every tp.
Chunks are in tp-rank order, the same order as parameter shards.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Callable

import torch

from parallel3d import comm

if TYPE_CHECKING:  # pragma: no cover
    from parallel3d.parallel_state import ParallelState

KIND = "tp"


def tp_group_size(pstate: "ParallelState") -> int:
    return comm.group_size(pstate, KIND)


def _all_reduce(x: torch.Tensor, pstate: "ParallelState") -> torch.Tensor:
    if tp_group_size(pstate) == 1:
        return x
    out = x.contiguous().clone()
    comm.all_reduce(out, pstate, KIND)
    return out


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _collective_along_dim(x: torch.Tensor, dim: int, out_size: int, collective: Callable[..., object],
                          pstate: "ParallelState", kind: str = KIND) -> torch.Tensor:
    # comm's gathers and scatters work along dim 0; move the wanted dim to the front and back again.
    front = x.movedim(dim, 0).contiguous()
    if all(size == 1 for size in x.shape[:dim]):
        # Only size-1 dims precede ``dim`` (micro-batch 1), so the result moved to dim 0 is contiguous:
        # collect straight into it, which is then no view of a dropped buffer, so a pipeline chunk
        # returning it (an embedding-only chunk under sequence parallel) has its sent output freed
        # (``activation_bytes.output_saved``). Allocated only here: the general path gathers into ``out``.
        shape = list(x.shape)
        shape[dim] = out_size
        result = torch.empty(shape, dtype=x.dtype, device=x.device)
        collective(result.movedim(dim, 0), front, pstate, kind)
        return result
    out = torch.empty((out_size, *front.shape[1:]), dtype=x.dtype, device=x.device)
    collective(out, front, pstate, kind)
    return out.movedim(0, dim).contiguous()


def all_gather_along_dim(x: torch.Tensor, dim: int, pstate: "ParallelState", kind: str = KIND) -> torch.Tensor:
    """Concatenate the ``kind`` group's (default tp) ``x`` along ``dim`` in group-rank order; no autograd."""
    n = comm.group_size(pstate, kind)
    if n == 1:
        return x
    return _collective_along_dim(x, dim, n * x.shape[dim], comm.all_gather_into_tensor, pstate, kind)


def reduce_scatter_along_dim(x: torch.Tensor, dim: int, pstate: "ParallelState") -> torch.Tensor:
    """Sum ``x`` over tp and keep this rank's chunk of ``dim``; no autograd."""
    n = tp_group_size(pstate)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(
            f"sequence parallel: dimension {dim} of size {x.shape[dim]} is not divisible by tp={n}"
        )
    return _collective_along_dim(x, dim, x.shape[dim] // n, comm.reduce_scatter_tensor, pstate)


def _split(x: torch.Tensor, dim: int, pstate: "ParallelState") -> torch.Tensor:
    n = tp_group_size(pstate)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"cannot split dimension {dim} of size {x.shape[dim]} over tp={n}")
    index = comm.group_rank(pstate, KIND)
    return x.chunk(n, dim=dim)[index].contiguous()


Op = Callable[[torch.Tensor], torch.Tensor]


class _OpAndTranspose(torch.autograd.Function):
    """``forward_op`` on the input, ``backward_op`` (its transpose) on the gradient: a row of the table."""

    @staticmethod
    def forward(ctx, x, forward_op: Op, backward_op: Op):  # type: ignore[override]
        ctx.backward_op = backward_op
        return forward_op(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return ctx.backward_op(grad), None, None


def _along(op: Callable[..., torch.Tensor], dim: int, pstate: "ParallelState") -> Op:
    return partial(op, dim=dim, pstate=pstate)


SEQ_DIM = 1  # activations are batch-first [b, s, h]


def copy_to_tp_region(x: torch.Tensor, pstate: "ParallelState") -> torch.Tensor:
    """f: identity forward, all-reduce of the gradient over tp."""
    return _OpAndTranspose.apply(x, _identity, partial(_all_reduce, pstate=pstate))


def reduce_from_tp_region(x: torch.Tensor, pstate: "ParallelState") -> torch.Tensor:
    """g: all-reduce (sum of partial results) forward, identity backward."""
    return _OpAndTranspose.apply(x, partial(_all_reduce, pstate=pstate), _identity)


def gather_last_dim(x: torch.Tensor, pstate: "ParallelState") -> torch.Tensor:
    """Concatenate every tp rank's last-dim chunk; backward keeps this rank's chunk."""
    dim = x.dim() - 1
    return _OpAndTranspose.apply(x, _along(all_gather_along_dim, dim, pstate), _along(_split, dim, pstate))


def split_last_dim(x: torch.Tensor, pstate: "ParallelState") -> torch.Tensor:
    """Keep this rank's chunk of the last dim; backward all-gathers the gradient."""
    dim = x.dim() - 1
    return _OpAndTranspose.apply(x, _along(_split, dim, pstate), _along(all_gather_along_dim, dim, pstate))


def gather_seq(x: torch.Tensor, pstate: "ParallelState") -> torch.Tensor:
    """SP entry to a column-parallel layer: [b, s/tp, h] -> [b, s, h]; backward reduce-scatters
    (each rank's copy fed a different branch). Column-parallel layers use
    ``gathered_linear.seq_gathered_linears`` instead, which does not keep the gathered copy."""
    return _OpAndTranspose.apply(x, _along(all_gather_along_dim, SEQ_DIM, pstate),
                                 _along(reduce_scatter_along_dim, SEQ_DIM, pstate))


def reduce_scatter_seq(x: torch.Tensor, pstate: "ParallelState") -> torch.Tensor:
    """SP exit of a row-parallel layer: partial [b, s, h] -> summed [b, s/tp, h]; backward all-gathers."""
    return _OpAndTranspose.apply(x, _along(reduce_scatter_along_dim, SEQ_DIM, pstate),
                                 _along(all_gather_along_dim, SEQ_DIM, pstate))


def split_seq(x: torch.Tensor, pstate: "ParallelState") -> torch.Tensor:
    """Keep this rank's sequence chunk of a replicated [b, s, h]; backward all-gathers."""
    return _OpAndTranspose.apply(x, _along(_split, SEQ_DIM, pstate), _along(all_gather_along_dim, SEQ_DIM, pstate))


def tp_chunk_start(chunk: int, pstate: "ParallelState") -> int:
    """Global start index of this rank's ``chunk``-sized piece of a dim split over tp
    (a sequence chunk under sequence parallelism, a vocabulary shard)."""
    return comm.group_rank(pstate, KIND) * chunk
