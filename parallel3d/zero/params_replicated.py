"""Parameter residency of ZeRO stages 0-2: every rank holds every parameter, all the time.

Parameters are views into one flat buffer per dtype (``buffers.FlatBuffer``). The
optimizer writes its updated pieces into the buffer (``piece``) and ``publish``
all-gathers every bucket's pieces over dp (stages 1-2; stage 0 updated the whole
buffer on every rank). ``params_sharded.ShardedParams`` is the stage-3
counterpart with the same interface.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from parallel3d import comm
from parallel3d.parallel_state import ParallelState
from parallel3d.zero.buffers import Bucket, BufferLayout, FlatBuffer
from parallel3d.zero.memory import MemoryTracker, nbytes


class ReplicatedParams:
    """Full parameters on every rank; ``sharded`` says whether pieces must be all-gathered after an update."""

    def __init__(self, layouts: list[BufferLayout], pstate: ParallelState, *, device: torch.device,
                 sharded: bool, memory: MemoryTracker) -> None:
        self.layouts, self.pstate = layouts, pstate
        self.sharded = sharded
        self.bufs = [FlatBuffer(layout, layout.dtype, device) for layout in layouts]
        for buf in self.bufs:
            buf.adopt_params()
        memory.add("model_weights", sum(nbytes(buf.data) for buf in self.bufs))

    def piece(self, group: int, bucket: Bucket) -> torch.Tensor:
        """This rank's piece of ``bucket`` in the model dtype (written by the optimizer)."""
        return self.bufs[group].piece_view(bucket)

    @torch.no_grad()
    def publish(self) -> None:
        """Make every rank's parameters whole after the pieces were updated (all-gather, stages 1-2)."""
        if not self.sharded:
            return
        works = []
        for buf in self.bufs:
            for b in buf.layout.buckets:
                # The collective must not read its own output buffer: send a copy of the piece.
                works.append(comm.all_gather_into_tensor(buf.bucket_view(b), buf.piece_view(b).clone(),
                                                         self.pstate, "dp", async_op=True))
        for w in works:
            if w is not None:
                w.wait()

    def release_all(self) -> None:
        """Nothing is ever released in stages 0-2."""

    @contextmanager
    def gathered(self) -> Iterator[None]:
        yield

    def storage_tensors(self) -> list[torch.Tensor]:
        return [buf.data for buf in self.bufs]
