"""Parameter residency of ZeRO stages 0-2: every rank holds every parameter, all the time.

Parameters are views into one flat buffer per dtype (``buffers.FlatBuffer``). The
optimizer writes its updated pieces into the buffer (``piece``) and ``publish``
all-gathers every bucket's pieces over its replica group (stages 1-2; stage 0 updated the whole
buffer on every rank). With ``overlap`` (``param_gather``) ``publish`` only
launches the gathers and the next forward waits for each bucket just before its
first reader; ``finish`` waits for all of them. ``params_sharded.ShardedParams``
is the stage-3 counterpart with the same interface.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from parallel3d.parallel_state import ParallelState
from parallel3d.zero.buffers import Bucket, BufferLayout, FlatBuffer
from parallel3d.zero.memory import MemoryTracker, nbytes
from parallel3d.zero.param_gather import ParamGatherOverlap, launch_gather
from parallel3d.zero.units import GatherUnit


class ReplicatedParams:
    """Full parameters on every rank; ``sharded`` says whether pieces must be all-gathered after an update.

    ``overlap_units``: the gather units whose forward pre-hooks wait for their buckets
    (``param_gather``); None gathers synchronously inside ``publish``."""

    def __init__(self, layouts: list[BufferLayout], pstate: ParallelState, *, device: torch.device,
                 sharded: bool, memory: MemoryTracker, overlap_units: list[GatherUnit] | None = None) -> None:
        self.layouts, self.pstate = layouts, pstate
        self.sharded = sharded
        self.bufs = [FlatBuffer(layout, layout.dtype, device) for layout in layouts]
        for buf in self.bufs:
            buf.adopt_params()
        memory.add("model_weights", sum(nbytes(buf.data) for buf in self.bufs))
        self.overlap = (ParamGatherOverlap(self.bufs, overlap_units, pstate)
                        if sharded and overlap_units is not None else None)

    def piece(self, group: int, bucket: Bucket) -> torch.Tensor:
        """This rank's piece of ``bucket`` in the model dtype (written by the optimizer)."""
        return self.bufs[group].piece_view(bucket)

    @torch.no_grad()
    def publish(self, *, asynchronous: bool = False) -> None:
        """Make every rank's parameters whole after the pieces were updated (all-gather, stages 1-2).
        ``asynchronous`` (with overlap): launch the gathers and return; readers wait (module doc)."""
        if not self.sharded:
            return
        if self.overlap is not None:
            self.overlap.start()
            if not asynchronous:
                self.overlap.wait_all()
            return
        launched = [launch_gather(buf, b, self.pstate) for buf in self.bufs for b in buf.layout.buckets]
        for work, _ in launched:
            if work is not None:
                work.wait()

    def finish(self) -> None:
        """Wait for every parameter gather still in flight (a no-op without overlap)."""
        if self.overlap is not None:
            self.overlap.wait_all()

    @property
    def gathers_in_flight(self) -> int:
        return 0 if self.overlap is None else self.overlap.pending

    def release_all(self) -> None:
        """Nothing is ever released in stages 0-2."""

    @contextmanager
    def gathered(self) -> Iterator[None]:
        self.finish()
        yield

    def storage_tensors(self) -> list[torch.Tensor]:
        return [buf.data for buf in self.bufs]
