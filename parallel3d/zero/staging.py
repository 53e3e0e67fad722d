"""Recycled bucket-sized staging buffers for stage 2's gradient reduction (and gloo's receive buffers).

A staging buffer holds one bucket's gradients (in the reduction dtype) from the
first gradient that arrives until its collective has completed. Buffers are
recycled, not freed: with backward producing gradients in bucket order, one
bucket fills while earlier ones reduce. ``MAX_STAGING_BUFFERS`` (4) lets up to
three reductions stay in flight behind the filling bucket: profiled on gloo
(bench_zero, dp=2), a limit of 2 made backward's hooks wait on the reduce-scatter
of the bucket before last (stage 2 spent its hook time there), where DDP never
waits in backward. The memory stays a constant few buckets, independent of
model size and accumulation. When none is free and that many exist, ``acquire`` waits for
the oldest collective in flight rather than allocating; it allocates beyond the
limit only when no collective is in flight (every buffer is held by a bucket
still accumulating, e.g. one spanning two model chunks, or one holding a
parameter without gradient). On gloo a reduce-scatter also receives into a
buffer of this kind until it completes (``reduction``): stage 2 takes it from the
same pool, whose limit is then ``GLOO_BUCKET_BUFFERS``; stage 1 has a pool of them alone.
"""

from __future__ import annotations

import torch

from parallel3d.zero.memory import MemoryTracker, nbytes
from parallel3d.zero.reduction import PendingCollectives

MAX_STAGING_BUFFERS = 4
# On gloo a reduce-scatter in flight also holds a bucket-sized receive buffer (``reduction``'s exchange):
# stage 2 takes both from its pool, stage 1 has a pool of receive buffers only, each of this size.
# 6: stage 2 keeps two reductions in flight behind the filling bucket (profiled, bench_zero dp=2: 4
# made backward's hooks wait on the reduction before last); together ~its memory before the
# exchange, when gloo's reduce-scatter cloned every bucket in flight.
GLOO_BUCKET_BUFFERS = 6


class StagingPool:
    """Flat buffers of ``numel`` elements of ``dtype``; their bytes count as ``buckets``."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, memory: MemoryTracker,
                 limit: int = MAX_STAGING_BUFFERS) -> None:
        self.numel, self.dtype, self.device = numel, dtype, device
        self.memory = memory
        self.limit = limit
        self.buffers: list[torch.Tensor] = []  # every buffer allocated (kept for reuse)
        self._free: list[torch.Tensor] = []

    def acquire(self, pending: PendingCollectives) -> torch.Tensor:
        """A buffer with undefined contents; may complete collectives of ``pending`` to get one."""
        pending.poll()
        while not self._free and len(self.buffers) >= self.limit and len(pending):
            pending.wait_oldest()
        if self._free:
            return self._free.pop()
        buf = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        self.buffers.append(buf)
        self.memory.add("buckets", nbytes(buf))
        return buf

    def release(self, buf: torch.Tensor) -> None:
        """Give ``buf`` back once nothing (no collective) reads or writes it any more."""
        self._free.append(buf)
