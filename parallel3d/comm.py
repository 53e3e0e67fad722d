"""Collectives over one of this rank's groups, with byte accounting and clear errors.

Every collective in parallel3d goes through here so that
- a group of size 1 (or a non-distributed run) is a no-op, so tp=1 / dp=1 /
  single-process runs share one code path;
- communication volume is counted per (group kind, op) in ``pstate.comm_stats``;
- a failed or timed-out collective raises an error naming this rank, the op and
  the group's ranks instead of a bare gloo/NCCL message. On NCCL this covers
  errors raised at launch or by ``wait`` only: a collective that hangs is found by
  ProcessGroupNCCL's watchdog, which tears the process down itself.

Point-to-point batches go through ``batch_isend_irecv``, whose result is one unit
whatever the backend returns (gloo: one Work per op; NCCL: one Work for the
batch). ``ParallelState(emulate_nccl=True)`` makes gloo behave like NCCL here
(``CoalescedWork``, ``EmulatedP2PStreams``) so that CPU tests catch code that
only works with one Work per op.

Every agreement between all ranks of the job (the stop decision, checkpoint commit
and damage checks, metrics, the run summary) goes through ``all_reduce_world``: one
collective over the ``world`` group, whatever dimensions the layout has.

Byte convention (``CommStats``): bytes *sent by this rank* under the ring
algorithm, for a payload of N bytes on n ranks: all-reduce 2N(n-1)/n,
reduce-scatter and all-gather N(n-1)/n (N = the full, unsharded size),
broadcast N, send N. With it a ZeRO reduce-scatter + all-gather costs exactly
what DDP's all-reduce costs, as the ZeRO paper says.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.distributed as dist

from parallel3d.comm_stats import CommStats
from parallel3d.p2p_emulation import CoalescedWork, EmulatedP2PStreams
from parallel3d.parallel_state import ParallelState

__all__ = ["AsyncSumAllReduce", "CoalescedWork", "CommStats", "EmulatedP2PStreams", "all_gather_exchange", "all_gather_into_tensor", "all_reduce",
           "all_reduce_world", "batch_isend_irecv", "broadcast", "group_rank", "group_size",
           "reduce_scatter_exchange", "reduce_scatter_tensor"]


def group_size(pstate: ParallelState, kind: str) -> int:
    """Members of this rank's ``kind`` group that take part in collectives (1 without groups)."""
    return len(pstate.ranks(kind)) if pstate.distributed else 1


def _failure(pstate: ParallelState, kind: str, op: str, exc: RuntimeError) -> RuntimeError:
    return RuntimeError(f"rank {pstate.rank}: {op} on the {kind} group {pstate.ranks(kind)} failed: {exc}")


@contextmanager
def _named_failure(pstate: ParallelState, kind: str, op: str) -> Iterator[None]:
    try:
        yield
    except RuntimeError as exc:  # gloo/NCCL errors (timeouts, dead peers) are RuntimeErrors
        raise _failure(pstate, kind, op, exc) from exc


# torch >= 2.13 renamed the tensor collectives (the old names warn on every call);
# GPU users may bring an older torch, so take whichever this torch has.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _check_sizes(pstate: ParallelState, kind: str, op: str, full: torch.Tensor, piece: torch.Tensor, n: int) -> None:
    """The whole buffer must be n pieces of one dtype. NCCL and gloo check this themselves, but a
    fake backend (the dry run's) does not: checked here, the dry run's step finds a bad ZeRO bucket."""
    if full.numel() != n * piece.numel() or full.dtype != piece.dtype:
        raise ValueError(f"rank {pstate.rank}: {op} on the {kind} group {pstate.ranks(kind)}: the whole buffer "
                         f"({full.numel()} x {full.dtype}) is not {n} pieces of {piece.numel()} x {piece.dtype}")


def all_reduce(
    tensor: torch.Tensor,
    pstate: ParallelState,
    kind: str,
    op: dist.ReduceOp = dist.ReduceOp.SUM,
    async_op: bool = False,
):
    """In-place all-reduce over this rank's ``kind`` group. Returns a Work if ``async_op``."""
    n = group_size(pstate, kind)
    if n == 1:
        return None
    pstate.comm_stats.add(kind, "all_reduce", _all_reduce_bytes(tensor, n))
    with _named_failure(pstate, kind, "all_reduce"):
        return dist.all_reduce(tensor, op=op, group=pstate.group(kind), async_op=async_op)


def _all_reduce_bytes(tensor: torch.Tensor, n: int) -> float:
    return 2 * _nbytes(tensor) * (n - 1) / n


class AsyncSumAllReduce:
    """``all_reduce(t, pstate, kind, async_op=True)`` for a caller launching many per step from
    backward hooks (ZeRO's gradient buckets): the group, its size and the options are looked up
    once, and each call goes to the process group directly, as DDP's C++ reducer does, without
    ``dist.all_reduce``'s per-call Python (argument checks, complex-tensor and coalescing-context
    handling: the callers pass dense real tensors, outside any coalescing context). The same
    collective, byte accounting and error naming as ``all_reduce``; ``__call__`` returns its Work
    (None when the group has one member)."""

    def __init__(self, pstate: ParallelState, kind: str) -> None:
        self._pstate, self._kind = pstate, kind
        self.size = group_size(pstate, kind)
        self._group = pstate.group(kind) if self.size > 1 else None
        self._opts = dist.AllreduceOptions()
        self._opts.reduceOp = dist.ReduceOp.SUM
        self._opts.asyncOp = True  # what ``dist.all_reduce(async_op=True)`` sets (NCCL: its own stream)

    def __call__(self, tensor: torch.Tensor):
        if self._group is None:
            return None
        self._pstate.comm_stats.add(self._kind, "all_reduce", _all_reduce_bytes(tensor, self.size))
        try:
            return self._group.allreduce([tensor], self._opts)
        except RuntimeError as exc:
            raise _failure(self._pstate, self._kind, "all_reduce", exc) from exc


def all_reduce_world(tensor: torch.Tensor, pstate: ParallelState, op: dist.ReduceOp = dist.ReduceOp.SUM) -> None:
    """In-place all-reduce over every rank of the job (every rank must call it; a no-op on one rank)."""
    all_reduce(tensor, pstate, "world", op=op)


def all_gather_into_tensor(
    output: torch.Tensor, shard: torch.Tensor, pstate: ParallelState, kind: str, async_op: bool = False
):
    """Concatenate every member's ``shard`` (dim 0, group-rank order) into ``output``."""
    n = group_size(pstate, kind)
    if n == 1:
        output.copy_(shard.reshape(output.shape))
        return None
    _check_sizes(pstate, kind, "all_gather", output, shard, n)
    pstate.comm_stats.add(kind, "all_gather", _nbytes(output) * (n - 1) / n)
    with _named_failure(pstate, kind, "all_gather"):
        return _all_gather_single(output, shard.contiguous(), group=pstate.group(kind), async_op=async_op)


def all_gather_exchange(output: torch.Tensor, pstate: ParallelState, kind: str, tag: int) -> CoalescedWork | None:
    """An in-place all-gather by point-to-point messages (tagged ``tag``); returns one Work (None: n == 1).

    ``output`` is n equal pieces (dim 0) and this member's slot (its group rank) already holds its
    piece: that slot is sent to every other member and theirs land in their slots, with no copy on
    either side. It sends an all-gather's (n-1)/n of ``output``, counted as one. For gloo, whose
    ``all_gather_into_tensor`` gathers into a temporary and copies it out and must be given its
    input apart from the output (a copy). Neither slot may be touched until the Work is waited for."""
    n = group_size(pstate, kind)
    if n == 1:
        return None
    if output.numel() % n:
        raise ValueError(f"rank {pstate.rank}: all_gather_exchange on the {kind} group: {output.numel()} elements "
                         f"are not n={n} equal pieces")
    pstate.comm_stats.add(kind, "all_gather", _nbytes(output) * (n - 1) / n)
    me, piece, group = group_rank(pstate, kind), output.numel() // n, pstate.group(kind)
    works = []
    with _named_failure(pstate, kind, "all_gather"):
        for j, peer in enumerate(pstate.ranks(kind)):
            if j != me:
                works.append(dist.isend(output[me * piece : (me + 1) * piece], peer, group=group, tag=tag))
                works.append(dist.irecv(output[j * piece : (j + 1) * piece], peer, group=group, tag=tag))
    return CoalescedWork(works)


def reduce_scatter_tensor(
    output: torch.Tensor,
    full: torch.Tensor,
    pstate: ParallelState,
    kind: str,
    op: dist.ReduceOp = dist.ReduceOp.SUM,
    async_op: bool = False,
):
    """Reduce ``full`` over the group and keep this member's dim-0 chunk in ``output``."""
    n = group_size(pstate, kind)
    if n == 1:
        output.copy_(full.reshape(output.shape))
        return None
    _check_sizes(pstate, kind, "reduce_scatter", full, output, n)
    pstate.comm_stats.add(kind, "reduce_scatter", _nbytes(full) * (n - 1) / n)
    with _named_failure(pstate, kind, "reduce_scatter"):
        return _reduce_scatter_single(
            output, full.contiguous(), op=op, group=pstate.group(kind), async_op=async_op
        )


def reduce_scatter_exchange(full: torch.Tensor, received: torch.Tensor, pstate: ParallelState, kind: str):
    """The communication of a reduce-scatter as one async all-to-all; returns its Work (None: n == 1).

    Member j is sent its piece of ``full`` (n equal pieces, dim 0) and this member's piece of
    every member's ``full`` lands in ``received`` (same size: slot j from member j, this member's
    own slot a local copy); the caller sums the slots once the Work has completed. What it sends
    is a reduce-scatter's (n-1)/n of ``full``, counted as one. For gloo, whose
    ``reduce_scatter_tensor`` all-reduces a clone of ``full`` (twice those bytes, plus a copy of the
    whole buffer on the calling thread) and only writes the output inside ``wait``."""
    n = group_size(pstate, kind)
    if n == 1:
        received.copy_(full)
        return None
    if full.numel() != received.numel() or full.numel() % n or full.dtype != received.dtype:
        raise ValueError(f"rank {pstate.rank}: reduce_scatter_exchange on the {kind} group: {full.numel()} x "
                         f"{full.dtype} into {received.numel()} x {received.dtype} is not n={n} equal pieces")
    pstate.comm_stats.add(kind, "reduce_scatter", _nbytes(full) * (n - 1) / n)
    with _named_failure(pstate, kind, "reduce_scatter"):
        return dist.all_to_all_single(received, full.contiguous(), group=pstate.group(kind), async_op=True)


def broadcast(tensor: torch.Tensor, pstate: ParallelState, kind: str, src_global_rank: int):
    """Broadcast ``tensor`` in place from global rank ``src_global_rank`` of the ``kind`` group."""
    n = group_size(pstate, kind)
    if n == 1:
        return None
    if pstate.rank == src_global_rank:
        pstate.comm_stats.add(kind, "broadcast", _nbytes(tensor))
    with _named_failure(pstate, kind, "broadcast"):
        return dist.broadcast(tensor, src=src_global_rank, group=pstate.group(kind))


def group_rank(pstate: ParallelState, kind: str) -> int:
    """This rank's index inside its ``kind`` group (0 when not distributed)."""
    ranks = pstate.ranks(kind)
    return ranks.index(pstate.rank) if pstate.distributed and ranks else 0


def batch_isend_irecv(ops: list[dist.P2POp], pstate: ParallelState, kind: str = "pp") -> list[Any]:
    """Post ``ops`` (all on this rank's ``kind`` group) as one batch; return the backend's Works.

    gloo returns one Work per op, NCCL one Work for the whole batch, so the list is one
    unit: wait for all of it before reading any received tensor, and keep every sent
    tensor referenced until all of it has completed. Under ``pstate.emulate_nccl`` the
    ops go out on gloo and one ``CoalescedWork`` comes back, after the previous batch on
    the group has completed (``EmulatedP2PStreams``). Byte accounting is the caller's.
    """
    if not ops:
        return []
    group = pstate.group(kind)
    if any(op.group is not group for op in ops):
        raise ValueError(f"rank {pstate.rank}: batch_isend_irecv got ops outside its {kind} group")
    streams = pstate.emulated_p2p_streams
    with _named_failure(pstate, kind, "batch_isend_irecv"):
        if streams is None:
            return dist.batch_isend_irecv(ops)
        streams.before_post(kind)
        work = CoalescedWork(dist.batch_isend_irecv(ops))
        streams.posted(kind, work)
        return [work]
