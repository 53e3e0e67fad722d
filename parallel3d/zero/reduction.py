"""Asynchronous reduction of one bucket over its replica group, and the queue of collectives in flight.

Each call names the group kind it reduces over (the bucket's ``BufferLayout.reduce_kind``:
``dp_cp`` for dense parameters, ``edp`` for routed experts). ``BucketReducer`` is the one place that
divides gradients: by the number of data replicas ``n = dp x cp`` whatever group it reduces over (an
expert's gradient is summed over ``edp`` and its ep peers' tokens, but it is still the mean over the
dp x cp micro-batch replicas, not over ``edp``). It multiplies each bucket by ``1/n`` right
before its collective (no pass when n == 1), so every reduced value is already
the replica *mean* and a half-precision partial sum never exceeds the largest
per-rank value (fp16 cannot overflow in the reduction at large n just because it
sums). Nobody downstream scales by n. A caller that already wrote a bucket scaled (stage 0/1's
first write of a gradient into its bucket, ``grad_replicated``: the copy it makes anyway, with
``scale_into``) says so with ``scaled=True``, and the pass is skipped; ``scale_into`` and ``scale_``
are the same multiplication by the same factor, so the values are bitwise those of the bucket pass.

Collectives are launched with ``async_op=True`` and completed in launch order by
``PendingCollectives``: ``poll`` uses the non-blocking ``is_completed``; ``wait``
on NCCL only orders the current stream after the collective, so every
completion callback (copy/add of the result, recycling a staging buffer) runs
on the current stream after it. The tensors a collective reads or writes stay
referenced by its queue entry until it has completed.

A reduce-scatter on gloo is an exchange (``comm.reduce_scatter_exchange``): one all-to-all
sends each member its piece of the bucket, this rank's piece of every member's bucket lands in
a bucket-sized receive buffer (``receive_pool``: recycled, counted as ``buckets``), and the
completion callback sums the received pieces into this rank's piece (its own contribution
first, then the others in group-rank order: every piece is summed by the one rank owning it).
gloo's own ``reduce_scatter_tensor`` is an all-reduce of a clone of the whole bucket: twice a
reduce-scatter's bytes, a bucket copy on the calling (backward) thread, and no completion
visible to ``poll`` (its Work only writes the output inside ``wait``). NCCL keeps its native
in-place reduce-scatter.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Protocol

import torch

from parallel3d import comm
from parallel3d.parallel_state import ParallelState


DATA_REPLICAS_KIND = "dp_cp"  # the ranks reading different micro-batches: every gradient is a mean over them


def _noop() -> None:
    return None


class PendingCollectives:
    """Async works in launch order, each with a completion callback run exactly once, in order."""

    def __init__(self) -> None:
        self._queue: deque[tuple[object, Callable[[], None], tuple[torch.Tensor, ...]]] = deque()

    def add(self, work, done: Callable[[], None], keep: tuple[torch.Tensor, ...] = ()) -> None:
        """Track ``work`` (None: the collective already ran, e.g. a size-1 group); ``keep`` stays alive until done."""
        if work is None and not self._queue:
            done()
            return
        self._queue.append((work, done, keep))

    def poll(self) -> None:
        """Complete the collectives at the front that have finished, without blocking."""
        while self._queue:
            work = self._queue[0][0]
            if work is not None and not work.is_completed():
                return
            self.wait_oldest()

    def wait_oldest(self) -> None:
        work, done, _keep = self._queue.popleft()
        if work is not None:
            work.wait()
        done()

    def drain(self) -> None:
        while self._queue:
            self.wait_oldest()

    def __len__(self) -> int:
        return len(self._queue)


def _deliver(target: torch.Tensor, src: torch.Tensor, accumulate: bool) -> None:
    if accumulate:
        target.add_(src)
    elif target.data_ptr() != src.data_ptr():
        target.copy_(src)


class BufferPool(Protocol):
    """Recycled flat buffers (``staging.StagingPool``)."""

    def acquire(self, pending: PendingCollectives) -> torch.Tensor: ...

    def release(self, buf: torch.Tensor) -> None: ...


class BucketReducer:
    """Starts the reduction of one padded bucket over the group ``kind`` (``numel % n == 0``).

    ``as_all_reduce``: reduce-scatters are done as an in-place all-reduce of the
    whole bucket, keeping this rank's piece (gloo's opt-in fast path, see
    ``grad_sync``). A reduce-scatter given a ``receive_pool`` (gloo) is an exchange received
    into one of its buffers (module doc); otherwise it never allocates: its output is the
    target or the bucket's own piece.
    """

    def __init__(self, pstate: ParallelState, *, as_all_reduce: bool, pending: PendingCollectives) -> None:
        self.pstate = pstate
        self.as_all_reduce = as_all_reduce
        self.pending = pending
        self._replicas = comm.group_size(pstate, DATA_REPLICAS_KIND)  # fixed for the job: looked up once
        self._all_reducers: dict[str, comm.AsyncSumAllReduce] = {}  # per kind, prepared once (launched per bucket)

    def scale_(self, t: torch.Tensor) -> None:
        """``t`` times ``1/n`` in place (nothing when n == 1)."""
        if self._replicas > 1:
            t.mul_(1.0 / self._replicas)

    def scale_into(self, out: torch.Tensor, src: torch.Tensor) -> None:
        """``out = src * (1/n)`` in one pass (a copy when n == 1): ``scale_`` of a copy, bitwise."""
        if self._replicas > 1:
            torch.mul(src, 1.0 / self._replicas, out=out)
        else:
            out.copy_(src)

    def _all_reducer(self, kind: str) -> comm.AsyncSumAllReduce:
        launch = self._all_reducers.get(kind)
        if launch is None:
            launch = self._all_reducers[kind] = comm.AsyncSumAllReduce(self.pstate, kind)
        return launch

    def all_reduce(self, full: torch.Tensor, kind: str, on_done: Callable[[], None] = _noop, *,
                   scaled: bool = False) -> None:
        """``full`` becomes the sum over the ``kind`` group divided by the data replicas, in place (stage 0);
        ``scaled``: the caller already divided ``full`` (module doc)."""
        launch = self._all_reducer(kind)
        if not scaled:
            self.scale_(full)
        if launch.size == 1:
            on_done()
            return
        self.pending.add(launch(full), on_done, (full,))

    def reduce_scatter(self, full: torch.Tensor, target: torch.Tensor, kind: str, *, accumulate: bool,
                       on_done: Callable[[], None] = _noop, receive_pool: BufferPool | None = None,
                       scaled: bool = False) -> None:
        """This rank's piece of the mean of ``full`` over the ``kind`` group is written into (or, if
        ``accumulate``, added to) ``target`` (``full.numel() // n`` elements; it may be ``full``'s own
        piece). ``full`` is scaled in place (unless ``scaled``: the caller did) and must not be touched
        until ``on_done`` runs; this rank's piece of it may be overwritten by the result.

        No copy on the way: a target that is ``full``'s own piece is reduced in place (the output
        is the input's piece, as NCCL's in-place reduce-scatter, and gloo's, accept); a separate
        target receives the collective's output directly; accumulating lands in ``full``'s own
        piece and adds that to the target (a collective cannot add)."""
        n = comm.group_size(self.pstate, kind)
        piece = full.numel() // n
        index = comm.group_rank(self.pstate, kind)
        mine = full[index * piece : (index + 1) * piece]
        if not scaled:
            self.scale_(full)
        if n == 1:
            _deliver(target, mine, accumulate)
            on_done()
            return
        if self.as_all_reduce:
            work = self._all_reducer(kind)(full)

            def done_all_reduce() -> None:
                _deliver(target, mine, accumulate)
                on_done()

            self.pending.add(work, done_all_reduce, (full,))
            return
        if receive_pool is not None:
            self._exchange(full, target, mine, kind, index, n, accumulate, on_done, receive_pool)
            return
        if _is_piece_of(target, mine):  # in place: NCCL's documented in-place form, and gloo's
            work = comm.reduce_scatter_tensor(mine, full, self.pstate, kind, async_op=True)
            self.pending.add(work, on_done, (full,))
            return
        if _storage_id(target) == _storage_id(full):
            raise ValueError("reduce_scatter: the target shares the bucket's storage but is not this rank's piece")
        if not accumulate:  # land straight in the target
            work = comm.reduce_scatter_tensor(target, full, self.pstate, kind, async_op=True)
            self.pending.add(work, on_done, (full, target))
            return
        # A collective cannot add: land in this rank's own piece of ``full`` (in place, no
        # temporary; ``full`` is the caller's until ``on_done``), then add that to the target.
        work = comm.reduce_scatter_tensor(mine, full, self.pstate, kind, async_op=True)

        def done_accumulate() -> None:
            target.add_(mine)
            on_done()

        self.pending.add(work, done_accumulate, (full, target))


    def _exchange(self, full: torch.Tensor, target: torch.Tensor, mine: torch.Tensor, kind: str, index: int, n: int,
                  accumulate: bool, on_done: Callable[[], None], pool: BufferPool) -> None:
        """The reduce-scatter as an exchange plus a local sum (module doc)."""
        base = pool.acquire(self.pending)
        received = base[: full.numel()]
        work = comm.reduce_scatter_exchange(full, received, self.pstate, kind)
        piece = mine.numel()
        others = [received[j * piece : (j + 1) * piece] for j in range(n) if j != index]

        def done_exchange() -> None:
            if accumulate or _is_piece_of(target, mine):
                for other in others:  # the piece's sum, in place
                    mine.add_(other)
                _deliver(target, mine, accumulate)
            else:  # the first add writes the target: no pass over ``mine`` to copy it there
                torch.add(mine, others[0], out=target)
                for other in others[1:]:
                    target.add_(other)
            pool.release(base)
            on_done()

        self.pending.add(work, done_exchange, (full, target, base))


def _is_piece_of(target: torch.Tensor, mine: torch.Tensor) -> bool:
    """Whether ``target`` is exactly ``mine`` (this rank's piece of the reduced buffer)."""
    return (target.data_ptr() == mine.data_ptr() and target.numel() == mine.numel()
            and _storage_id(target) == _storage_id(mine))


def _storage_id(t: torch.Tensor) -> int:
    """Which storage ``t`` views. Meta storages (the dry run) all report data pointer 0, so there the
    storage object itself is compared."""
    return t.untyped_storage()._cdata if t.is_meta else t.untyped_storage().data_ptr()
