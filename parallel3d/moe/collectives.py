"""Collectives of the MoE token exchange over explicit process groups.

Every function takes the group it runs on (a ``torch.distributed.ProcessGroup``, or
``None`` for a group of one, where it is the identity) so the caller decides which
group is the expert-parallel (``ep``) or expert-tensor-parallel (``etp``) one. Members
hold *different* rows; a row's order in a gathered tensor is member order (group rank).

Autograd pairs (each is the other's transpose, so forward and backward communicate once):

==========================  =====================================  ==========================
function                    forward                                backward
==========================  =====================================  ==========================
``all_to_all``              rows to members by ``send_splits``     the reverse exchange
``gather_rows``             concatenate every member's rows        ``reduce_scatter_rows``
``reduce_scatter_rows``     sum every member's copy of my rows     ``gather_rows``
==========================  =====================================  ==========================

Uneven gathers and reduce-scatters are all-to-alls (gloo has no uneven all-gather;
NCCL has, but one code path serves both): a gather sends its rows to every member,
a reduce-scatter sends each member its rows and sums what comes back in member order
(deterministic: the same order on every rank and every run).

NCCL semantics. The token counts are exchanged with an asynchronous all-to-all on the
device, then moved to the host once per dispatch (``to_host``): on CUDA that copy is
the one device-to-host synchronisation the uneven exchange needs (its split sizes are
host integers). On NCCL a count buffer is valid only after its Work was waited on
(the collective runs on another stream); gloo usually has finished by then, so a
missing ``wait`` goes unseen. ``exchange_counts(..., emulate_nccl=True)`` makes it
visible on CPU: the received buffer holds ``POISON`` until ``wait``.
``HostSyncs`` counts the synchronisations, so tests can hold the dispatcher to one.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Protocol, Sequence

import torch
import torch.distributed as dist

Group = "dist.ProcessGroup | None"
POISON = -(2**30)  # what an emulated NCCL count buffer holds until its Work is waited on
# torch >= 2.13 renamed the tensor all-gather (the old name warns on every call); older torch has only the old one.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ByteCounter(Protocol):
    """``parallel3d.comm.CommStats`` or anything with its ``add``."""

    def add(self, kind: str, op: str, nbytes: float) -> None: ...


def group_size(group: "dist.ProcessGroup | None") -> int:
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: "dist.ProcessGroup | None") -> int:
    if group is None or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


@contextmanager
def _named(group: "dist.ProcessGroup", op: str, kind: str) -> Iterator[None]:
    try:
        yield
    except RuntimeError as exc:  # gloo/NCCL failures and timeouts arrive as RuntimeError
        ranks = dist.get_process_group_ranks(group)
        raise RuntimeError(f"rank {dist.get_rank()}: {op} on the {kind} group {ranks} failed: {exc}") from exc


class HostSyncs:
    """How many device-to-host synchronisations the exchanges made (``to_host`` calls)."""

    def __init__(self) -> None:
        self.count = 0


def to_host(t: torch.Tensor, syncs: HostSyncs | None) -> list[int]:
    """``t`` (integer counts on the compute device) as host integers: one blocking copy."""
    if syncs is not None:
        syncs.count += 1
    values = t.to("cpu").tolist()
    if any(v < 0 for v in values):
        raise RuntimeError("MoE token counts read before their exchange completed (negative counts)")
    return values


class PendingCounts:
    """An in-flight count all-to-all; ``wait()`` returns the received counts (on the device)."""

    def __init__(self, output: torch.Tensor, work: object | None, staging: torch.Tensor | None) -> None:
        self.output = output  # what a careless reader would read before wait (NCCL: not yet valid)
        self._work, self._staging = work, staging

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
            if self._staging is not None:  # emulated stream: the result lands at wait, not before
                self.output.copy_(self._staging)
                self._staging = None
        return self.output


def exchange_counts(send: torch.Tensor, group: "dist.ProcessGroup | None", *, emulate_nccl: bool = False,
                    kind: str = "ep", stats: ByteCounter | None = None) -> PendingCounts:
    """Start the all-to-all of ``send`` (``[n * per]`` int64, member-major): member ``j`` gets
    ``send[j*per:(j+1)*per]``.

    The result ``[n * per]`` is member-major too: block ``i`` is what member ``i`` sent to this rank.
    """
    n = group_size(group)
    if n == 1:
        return PendingCounts(send, None, None)
    send = send.contiguous()
    output = torch.empty_like(send)
    if stats is not None:
        stats.add(kind, "all_to_all", send.numel() * send.element_size() * (n - 1) / n)
    with _named(group, "count all_to_all", kind):
        if emulate_nccl:
            output.fill_(POISON)
            staging = torch.empty_like(send)
            work = dist.all_to_all_single(staging, send, group=group, async_op=True)
            return PendingCounts(output, work, staging)
        work = dist.all_to_all_single(output, send, group=group, async_op=True)
    return PendingCounts(output, work, None)


def all_gather_counts(counts: torch.Tensor, group: "dist.ProcessGroup | None", *, kind: str = "etp",
                      stats: ByteCounter | None = None) -> torch.Tensor:
    """Every member's equally sized ``counts`` concatenated in member order (no autograd)."""
    n = group_size(group)
    if n == 1:
        return counts
    out = torch.empty(n * counts.numel(), dtype=counts.dtype, device=counts.device)
    if stats is not None:
        stats.add(kind, "all_gather", out.numel() * out.element_size() * (n - 1) / n)
    with _named(group, "count all_gather", kind):
        _all_gather_single(out, counts.contiguous(), group=group)
    return out


def _exchange(x: torch.Tensor, group: "dist.ProcessGroup", send: Sequence[int], recv: Sequence[int],
              kind: str, stats: ByteCounter | None) -> torch.Tensor:
    row = x[0].numel() * x.element_size() if x.dim() and x.shape[0] else 0
    out = torch.empty((sum(recv), *x.shape[1:]), dtype=x.dtype, device=x.device)
    if stats is not None:
        me = group_rank(group)
        stats.add(kind, "all_to_all", row * (sum(send) - send[me]))
    with _named(group, "all_to_all", kind):
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=list(recv), input_split_sizes=list(send),
                               group=group)
    return out


class _Transposed(torch.autograd.Function):
    """``forward_op(x, *forward_args)`` in forward, ``backward_op(grad, *backward_args)`` in backward."""

    @staticmethod
    def forward(ctx, x, forward_op, forward_args, backward_op, backward_args):  # type: ignore[override]
        ctx.backward_op, ctx.backward_args = backward_op, backward_args
        return forward_op(x, *forward_args)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return ctx.backward_op(grad, *ctx.backward_args), None, None, None, None


def all_to_all(x: torch.Tensor, group: "dist.ProcessGroup | None", send_splits: Sequence[int],
               recv_splits: Sequence[int], *, kind: str = "ep", stats: ByteCounter | None = None) -> torch.Tensor:
    """Rows ``x[sum(send[:j]) : sum(send[:j+1])]`` go to member ``j``; returns ``[sum(recv), ...]`` in member order."""
    if group_size(group) == 1:
        return x
    send, recv = list(send_splits), list(recv_splits)
    return _Transposed.apply(x, _exchange, (group, send, recv, kind, stats),
                             _exchange, (group, recv, send, kind, stats))


def _gather(x: torch.Tensor, group: "dist.ProcessGroup", sizes: Sequence[int], kind: str,
            stats: ByteCounter | None) -> torch.Tensor:
    n, me = len(sizes), group_rank(group)
    return _exchange(x.repeat(n, *([1] * (x.dim() - 1))), group, [sizes[me]] * n, sizes, kind, stats)


def _reduce_scatter(x: torch.Tensor, group: "dist.ProcessGroup", sizes: Sequence[int], kind: str,
                    stats: ByteCounter | None) -> torch.Tensor:
    n, me = len(sizes), group_rank(group)
    parts = _exchange(x, group, sizes, [sizes[me]] * n, kind, stats)
    parts = parts.view(n, sizes[me], *x.shape[1:])
    out = parts[0].clone()
    for i in range(1, n):  # fixed member order: bit-identical sums on every rank
        out += parts[i]
    return out


def gather_rows(x: torch.Tensor, group: "dist.ProcessGroup | None", sizes: Sequence[int], *, kind: str = "etp",
                stats: ByteCounter | None = None) -> torch.Tensor:
    """``[sizes[me], ...]`` -> every member's rows ``[sum(sizes), ...]`` in member order; sizes of all members."""
    if group_size(group) == 1:
        return x
    args = (group, list(sizes), kind, stats)
    return _Transposed.apply(x, _gather, args, _reduce_scatter, args)


def reduce_scatter_rows(x: torch.Tensor, group: "dist.ProcessGroup | None", sizes: Sequence[int], *,
                        kind: str = "etp", stats: ByteCounter | None = None) -> torch.Tensor:
    """``[sum(sizes), ...]`` (member blocks) -> ``[sizes[me], ...]``: my block summed over the members."""
    if group_size(group) == 1:
        return x
    args = (group, list(sizes), kind, stats)
    return _Transposed.apply(x, _reduce_scatter, args, _gather, args)


def all_reduce_sum(t: torch.Tensor, group: "dist.ProcessGroup | None", *, kind: str) -> torch.Tensor:
    """A new tensor: ``t`` summed over the group (no autograd; statistics only)."""
    if group_size(group) == 1:
        return t
    out = t.detach().clone()
    with _named(group, "all_reduce", kind):
        dist.all_reduce(out, group=group)
    return out


def gather_sizes(n_local: int, group: "dist.ProcessGroup | None", device: torch.device, *, kind: str,
                 syncs: HostSyncs | None = None) -> list[int]:
    """Every member's row count (host integers; one synchronisation)."""
    if group_size(group) == 1:
        return [n_local]
    mine = torch.tensor([n_local], dtype=torch.int64, device=device)
    return to_host(all_gather_counts(mine, group, kind=kind), syncs)
