"""ZeRO stages 2 and 3: gradients stay sharded on every microbatch, not only after the step.

Each rank keeps only its gradient shard (``layout.shard_numel`` elements of the
gradient dtype: fp32 main grads by default, or ``grad_reduce_dtype``) plus a
few bucket-sized staging buffers (``staging``). As DeepSpeed's stage 2 does,
every backward (every microbatch, not just the last one) reduces as it goes:

1. A bucket opens at its first gradient: it gets a zeroed pooled buffer, and each
   slot's main grad (``main_grad``) is a view of it. With the gradient dtype equal
   to the parameters' (fp32 training, or bf16 gradients), every ``.grad`` not set
   yet becomes that view, so autograd accumulates the bucket's later gradients
   straight into the buffer (as into Megatron's main-grad buffer); only the
   gradient that opened the bucket (or a ``.grad`` set outside backward) is added
   by the hook. With fp32 main grads of a bf16/fp16 model the hook adds each
   ``.grad`` into its view and drops it: no full-size gradient outlives its hook.
2. When every parameter of the bucket has contributed the same number of times
   (normally: once, in this backward), the bucket is complete: its ``.grad``
   views are detached, it is scaled by 1/dp and reduce-scattered from the hook,
   on the buffer itself; the result lands in this rank's shard (first time this
   step) or in the buffer's own piece and is added to the shard (a collective
   cannot add), and the buffer is recycled once the collective completed.
3. A bucket that is not complete at the end of a backward keeps accumulating in
   its staging buffer: one holding parameters of two model chunks (interleaved
   schedules run the chunks' backwards at different times) or a parameter that
   got no gradient. ``finalize`` launches these, treating missing gradients as 0.

So at any microbatch the gradient memory is the shard plus the pooled bucket
buffers plus the one separate ``.grad`` a hook is consuming. The price is DeepSpeed's: one
reduce-scatter per bucket per microbatch instead of per step.

Completion rule (2) is what makes any interleaving of chunks work: a launch
reduces a partial sum, and every contribution enters exactly one launch, so the
shard ends as the sum of all of them whatever the order; the rule itself is
deterministic in the gradient order, which is the same on every DP rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parallel3d.parallel_state import ParallelState
from parallel3d.zero.buffers import Bucket, BufferLayout, shard_slice
from parallel3d.zero.grad_sync import GradSync
from parallel3d.zero.memory import MemoryTracker, nbytes
from parallel3d.zero.staging import GLOO_BUCKET_BUFFERS, MAX_STAGING_BUFFERS, StagingPool


@dataclass
class _OpenBucket:
    """A bucket accumulating in a pooled buffer. ``counts[i]``: contributions of slot i so far;
    ``views[i]``: slot i's main grad, a view of ``base`` in the gradient dtype."""

    base: torch.Tensor  # the pooled buffer
    view: torch.Tensor  # base[:bucket.size]
    views: list[torch.Tensor]
    counts: list[int]
    total: int = 0
    most: int = 0

    @property
    def complete(self) -> bool:
        return self.total == self.most * len(self.counts)


class ShardedGradSync(GradSync):
    """Stages 2/3. ``grad_shards[g]``: this rank's DP-mean gradient shard (shard coordinates of group g)."""

    def __init__(self, modules: list[torch.nn.Module], layouts: list[BufferLayout], pstate: ParallelState, *,
                 device: torch.device, grad_dtype: torch.dtype, reduce_scatter: str, memory: MemoryTracker) -> None:
        super().__init__(modules, layouts, pstate, device=device, grad_dtype=grad_dtype,
                         reduce_scatter=reduce_scatter, memory=memory)
        self.grad_shards: list[torch.Tensor] = []
        self.pools: list[StagingPool] = []
        for layout in layouts:
            shard = torch.zeros(layout.shard_numel, dtype=grad_dtype, device=device)
            memory.add("gradients", nbytes(shard))
            self.grad_shards.append(shard)
            # On gloo a reduction in flight also holds a receive buffer from this pool (``reduction``).
            limit = GLOO_BUCKET_BUFFERS if self.exchanges else MAX_STAGING_BUFFERS
            self.pools.append(StagingPool(layout.max_bucket_size, grad_dtype, device, memory, limit=limit))
        # Same dtype: ``.grad`` itself is the bucket view while the bucket is open (autograd adds in place).
        self.in_place = [layout.dtype == grad_dtype for layout in layouts]
        self._open: dict[tuple[int, int], _OpenBucket] = {}
        self._reset_step()

    def grad_piece(self, group: int, bucket: Bucket) -> torch.Tensor:
        return shard_slice(self.grad_shards[group], bucket)

    def main_grad(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        g, b, i = self._where[id(param)]
        ob = self._open.get((g, b.index))
        return None if ob is None else ob.views[i]

    def gradient_tensors(self) -> list[torch.Tensor]:
        return list(self.grad_shards)

    def staging_buffers(self) -> list[torch.Tensor]:
        return [buf for pool in self.pools for buf in pool.buffers]

    # ---- strategy hooks ----------------------------------------------------------------
    def _on_grad_ready(self, group: int, bucket: Bucket, index: int, param: torch.nn.Parameter) -> None:
        ob = self._stage(group, bucket, index, param)
        if ob.complete:
            self._launch(group, bucket)

    @torch.no_grad()
    def _launch_leftovers(self) -> None:
        for g, layout in enumerate(self.layouts):
            for b in layout.buckets:
                key = (g, b.index)
                ob = self._open.get(key)
                for i, s in enumerate(b.slots):
                    grad = s.param.grad
                    if grad is not None and (ob is None or grad.data_ptr() != ob.views[i].data_ptr()):
                        ob = self._stage(g, b, i, s.param)  # a .grad set outside backward
                if ob is not None:
                    self._launch(g, b)  # a slot without gradient this step contributes its zeros
                elif key not in self._written:  # nothing arrived this step on any rank: no collective
                    shard_slice(self.grad_shards[g], b).zero_()

    def _reset_step(self) -> None:
        for (g, b), ob in self._open.items():  # a step abandoned mid-accumulation
            self._unbind(g, self.layouts[g].buckets[b], ob)
            self.pools[g].release(ob.base)
        self._open: dict[tuple[int, int], _OpenBucket] = {}
        self._written: set[tuple[int, int]] = set()  # buckets whose shard slice holds this step's sum

    def _zero_grads(self) -> None:
        for layout in self.layouts:
            for s in layout.slots:
                s.param.grad = None

    # ---- internals ---------------------------------------------------------------------
    def _open_bucket(self, group: int, bucket: Bucket) -> _OpenBucket:
        """A zeroed pooled buffer for ``bucket``; with ``in_place``, every slot's ``.grad`` that is
        not set yet becomes its view, so autograd accumulates the later gradients straight into it."""
        base = self.pools[group].acquire(self.pending)
        view = base[: bucket.size]
        view.zero_()  # padding and slots still to come (the sum starts at 0)
        views = [view[s.start - bucket.start : s.end - bucket.start].view(s.param.shape) for s in bucket.slots]
        ob = self._open[(group, bucket.index)] = _OpenBucket(base=base, view=view, views=views,
                                                             counts=[0] * len(bucket.slots))
        if self.in_place[group]:
            for s, v in zip(bucket.slots, views):
                if s.param.grad is None:
                    s.param.grad = v
        return ob

    def _stage(self, group: int, bucket: Bucket, index: int, param: torch.nn.Parameter) -> _OpenBucket:
        """(Grad mode off: from the hook or ``_launch_leftovers``.) Count ``param``'s new contribution, bringing ``param.grad`` into the bucket's view unless
        autograd accumulated it there already; a separate ``.grad`` does not outlive this hook."""
        ob = self._open.get((group, bucket.index)) or self._open_bucket(group, bucket)
        dst = ob.views[index]
        grad = param.grad
        if grad.data_ptr() != dst.data_ptr():
            self.memory.transient("gradients", nbytes(grad))
            dst.add_(grad)  # converts to the gradient dtype (main grads)
            param.grad = dst if self.in_place[group] else None
        ob.counts[index] += 1
        ob.total += 1
        ob.most = max(ob.most, ob.counts[index])
        return ob

    @staticmethod
    def _unbind(group: int, bucket: Bucket, ob: _OpenBucket) -> None:
        """Detach every ``.grad`` still viewing the bucket: its buffer goes to a collective or the pool."""
        for s, v in zip(bucket.slots, ob.views):
            grad = s.param.grad
            if grad is not None and grad.data_ptr() == v.data_ptr():
                s.param.grad = None

    def _launch(self, group: int, bucket: Bucket) -> None:
        key = (group, bucket.index)
        ob = self._open.pop(key)
        self._unbind(group, bucket, ob)
        accumulate = key in self._written
        self._written.add(key)
        pool = self.pools[group]
        # On gloo the exchange receives into a second buffer of the same pool.
        self.reducer.reduce_scatter(ob.view, shard_slice(self.grad_shards[group], bucket),
                                    self.layouts[group].reduce_kind, accumulate=accumulate,
                                    on_done=lambda: pool.release(ob.base),
                                    receive_pool=pool if self.exchanges else None)
