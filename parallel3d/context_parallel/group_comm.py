"""The collectives context-parallel attention runs on one cp (sub-)group.

``CPGroup`` wraps a process group and the global ranks it holds, in group order (the
order that defines cp-ranks and so which chunks a rank holds). It mirrors
``parallel3d.comm``: a group of size 1 (or ``group=None``) makes every op a no-op; bytes
*sent by this rank* are counted in a ``CommStats`` under ``(kind, op)`` with comm's
convention (send N; all-gather / reduce-scatter N(n-1)/n of the full size; all-to-all
N(n-1)/n of the local input); a failing op raises naming this rank, the op and the ranks.

Point-to-point traffic is one batch per ring step, returned as ONE handle whatever the
backend (NCCL returns one Work per batch, gloo one per op: code that zipped Works with ops
would work on gloo only). With ``p2p_streams`` (``comm.EmulatedP2PStreams``, what
``ParallelState(emulate_nccl=True)`` holds) a batch is posted only after this rank's
previous batch on the group completed, NCCL's FIFO order on one stream.

``all_to_all_pieces`` is an all-to-all as one such batch of point-to-point pieces, each received
where the caller wants it (Ulysses at batch 1 receives along the sequence in place, no copy out).

``all_to_all`` is written here because ``parallel3d.comm`` has no all-to-all yet; it
belongs there once the topology branch lands (kind ``"cp"``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch
import torch.distributed as dist

from parallel3d.comm import CoalescedWork, CommStats, EmulatedP2PStreams

if TYPE_CHECKING:  # pragma: no cover
    from parallel3d.parallel_state import ParallelState

# torch >= 2.13 renamed the tensor collectives; older GPU torches have only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def release(*tensors: torch.Tensor) -> None:
    """Free the memory of ``tensors`` now: buffers a finished collective used that the caller no
    longer reads (send buffers, receive buffers already copied out).

    Why not just drop them: gloo runs a collective on its worker thread, which holds the op's
    tensors until it next runs, after ``wait`` returned; the free then lands wherever thread
    scheduling puts it (measured: a layer's 3 MiB a2a buffers still allocated at the loss's
    backward in one run of five), so a rank's peak varied run to run. Emptying the storage here
    frees it at a defined point whatever still references the tensor (NCCL: the freed block is
    reused after the op's stream, as for any tensor the collective recorded). Invariant: the
    caller holds no view of a released storage it reads again."""
    for t in tensors:
        t.untyped_storage().resize_(0)


class _Done:
    """The handle of an op that needed no communication."""

    def wait(self, timeout: Any = None) -> bool:
        return True


class CPGroup:
    """One cp group (or sub-group): ``ranks`` are global ranks in group order, ``rank`` is ours."""

    def __init__(
        self, group: "dist.ProcessGroup | None", ranks: Sequence[int], rank: int, *, kind: str = "cp",
        stats: CommStats | None = None, p2p_streams: EmulatedP2PStreams | None = None,
    ) -> None:
        self.group, self.ranks, self.rank, self.kind = group, list(ranks), rank, kind
        if rank not in self.ranks:
            raise ValueError(f"rank {rank} is not in its {kind} group {self.ranks}")
        if group is None and len(self.ranks) > 1:
            raise ValueError(f"rank {rank}: the {kind} group {self.ranks} has {len(self.ranks)} ranks but no process group")
        self.stats = stats if stats is not None else CommStats()
        self.p2p_streams = p2p_streams
        self.index = self.ranks.index(rank)

    @classmethod
    def single(cls, kind: str = "cp") -> "CPGroup":
        """A group of one rank: every op is local."""
        return cls(None, [0], 0, kind=kind)

    @classmethod
    def from_pstate(cls, pstate: "ParallelState", kind: str = "cp") -> "CPGroup":
        """This rank's ``kind`` group of a ParallelState, with its byte counters and NCCL emulation."""
        ranks = pstate.ranks(kind) if pstate.distributed else [pstate.rank]
        return cls(pstate.group(kind) if len(ranks) > 1 else None, ranks, pstate.rank, kind=kind,
                   stats=pstate.comm_stats, p2p_streams=pstate.emulated_p2p_streams)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def next_rank(self) -> int:
        return self.ranks[(self.index + 1) % self.size]

    @property
    def prev_rank(self) -> int:
        return self.ranks[(self.index - 1) % self.size]

    @contextmanager
    def _named(self, op: str) -> Iterator[None]:
        try:
            yield
        except RuntimeError as exc:  # gloo/NCCL failures (timeouts, dead peers) are RuntimeErrors
            raise RuntimeError(f"rank {self.rank}: {op} on the {self.kind} group {self.ranks} failed: {exc}") from exc

    def ring_exchange(self, sends: Sequence[torch.Tensor], recvs: Sequence[torch.Tensor]):
        """Send ``sends`` to the next rank and receive ``recvs`` from the previous one, as one batch.

        Returns one handle; wait on it before reading ``recvs`` or writing ``sends``."""
        if self.size == 1:
            raise ValueError(f"rank {self.rank}: ring_exchange on a {self.kind} group of one rank")
        ops = [dist.P2POp(dist.isend, t, self.next_rank, group=self.group) for t in sends]
        ops += [dist.P2POp(dist.irecv, t, self.prev_rank, group=self.group) for t in recvs]
        self.stats.add(self.kind, "send", _nbytes(sends))
        return self._post(ops, "ring_exchange")

    def _post(self, ops: list, op: str) -> CoalescedWork:
        with self._named(op):
            if self.p2p_streams is not None:
                self.p2p_streams.before_post(self.kind)
            work = CoalescedWork(dist.batch_isend_irecv(ops))
            if self.p2p_streams is not None:
                self.p2p_streams.posted(self.kind, work)
        return work

    def all_to_all_pieces(self, sends: Sequence[tuple[int, torch.Tensor]],
                          recvs: Sequence[tuple[int, torch.Tensor]]) -> None:
        """An all-to-all as one batch of point-to-point pieces, so that each piece lands in a buffer of
        the caller's choosing (e.g. in place along the sequence): ``(member index, contiguous tensor)``
        pairs, every other member's sends matched by this one's recvs from it in the same order.
        Nothing goes to this rank itself (the caller copies its own pieces). Counted as ``all_to_all``
        (what leaves the rank: N(n-1)/n of the local input, comm's convention); returns when done."""
        if self.size == 1:
            raise ValueError(f"rank {self.rank}: all_to_all_pieces on a {self.kind} group of one rank")
        ops = [dist.P2POp(dist.isend, t, self.ranks[m], group=self.group) for m, t in sends]
        ops += [dist.P2POp(dist.irecv, t, self.ranks[m], group=self.group) for m, t in recvs]
        self.stats.add(self.kind, "all_to_all", _nbytes([t for _, t in sends]))
        work = self._post(ops, "all_to_all")
        with self._named("all_to_all"):
            work.wait()

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, async_op: bool = False):
        """Every member's ``shard`` concatenated along dim 0 (group order) into ``output``."""
        if self.size == 1:
            output.copy_(shard.reshape(output.shape))
            return _Done()
        self.stats.add(self.kind, "all_gather", _nbytes([output]) * (self.size - 1) / self.size)
        with self._named("all_gather"):
            work = _all_gather_single(output, shard.contiguous(), group=self.group, async_op=async_op)
        return work if async_op else _Done()

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor) -> None:
        """Sum ``full`` over the group; keep this member's dim-0 block in ``output``."""
        if self.size == 1:
            output.copy_(full.reshape(output.shape))
            return
        self.stats.add(self.kind, "reduce_scatter", _nbytes([full]) * (self.size - 1) / self.size)
        with self._named("reduce_scatter"):
            _reduce_scatter_single(output, full.contiguous(), group=self.group)

    def all_to_all(self, output: torch.Tensor, inp: torch.Tensor) -> None:
        """Block ``j`` of ``inp`` (dim 0 cut in ``size`` equal blocks) goes to member ``j``; block
        ``i`` of ``output`` comes from member ``i``."""
        if self.size == 1:
            output.copy_(inp)
            return
        self.stats.add(self.kind, "all_to_all", _nbytes([inp]) * (self.size - 1) / self.size)
        with self._named("all_to_all"):
            sent = inp.contiguous()
            dist.all_to_all_single(output, sent, group=self.group)
        if sent is not inp:  # our own copy: freed now, not when gloo's worker lets go of it (``release``)
            release(sent)
