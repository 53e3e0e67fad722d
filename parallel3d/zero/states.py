"""Where the optimizer state lives and the update runs: the device, host memory, or disk.

The state is the fp32 master weights and the two Adam moments of this rank's
shard, flat and in shard coordinates (``buffers``: bucket ``b``'s piece is
``[b.shard_offset, b.shard_offset + b.piece_size)``), whatever ``offload`` is,
so a checkpoint sees the same pieces in every mode:

- ``none`` (``DeviceStates``): tensors on the device. With fp32 parameters the
  model's own piece is the master (no copy).
- ``cpu`` (``offload.HostStates``): tensors in host memory (pinned on CUDA); the
  update runs on the host while gradients stream down and parameters back up.
- ``disk`` (``offload.DiskStates``): files under ``offload_dir``, streamed
  through a bounded host buffer in chunks.

The optimizer drives an update through ``update_chunks``: each yielded
``StateChunk`` holds a range of one bucket's piece with its master, moments and
(unscaled) gradient on the store's compute device; the optimizer updates master
and moments in place, and when it asks for the next chunk the store persists
them and writes the master, in the model dtype, into the parameters' piece.
``read_piece``/``write_piece`` give checkpoints the state of one piece in any mode.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from parallel3d.zero.buffers import Bucket, BufferLayout, shard_slice
from parallel3d.zero.memory import MemoryTracker, nbytes

PieceOf = Callable[[int, Bucket], torch.Tensor]  # (group, bucket) -> this rank's piece (grad or param)


@dataclass
class StateChunk:
    """Elements ``[lo, hi)`` of this rank's piece of ``bucket`` (group ``group``), on the compute device."""

    group: int
    bucket: Bucket
    lo: int
    hi: int
    master: torch.Tensor  # fp32, updated in place
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grad: torch.Tensor  # gradient dtype, DP mean times the loss scale


def pieces(layouts: list[BufferLayout]) -> list[tuple[int, Bucket]]:
    return [(g, b) for g, layout in enumerate(layouts) for b in layout.buckets]


class OptimizerStates(ABC):
    """fp32 master weights and Adam moments of this rank's shard; see the module doc."""

    offload: str = "none"
    on_host: bool = False  # the update runs on the host (CPU AdamW)

    def __init__(self, layouts: list[BufferLayout], memory: MemoryTracker) -> None:
        self.layouts = layouts
        self.memory = memory

    @abstractmethod
    def update_chunks(self, grad_piece: PieceOf, param_piece: PieceOf) -> Iterator[StateChunk]:
        """Every chunk of the shard once, in bucket order (module doc)."""

    @abstractmethod
    def read_piece(self, group: int, bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(master, exp_avg, exp_avg_sq) of this rank's piece, fp32: in-place views in every mode (disk:
        of the memory-mapped files), so writing them changes the state."""

    @abstractmethod
    def write_piece(self, group: int, bucket: Bucket, master: torch.Tensor, exp_avg: torch.Tensor,
                    exp_avg_sq: torch.Tensor) -> None:
        """Store the piece's state (a no-op for the views ``read_piece`` returned in memory modes)."""

    def device_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(master tensors, moment tensors) held on the training device, for ``memory_bytes``."""
        return [], []

    def host_bytes(self) -> int:
        return 0

    def disk_bytes(self) -> int:
        return 0

    def close(self) -> None:
        """Release files and threads (disk)."""


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.data_ptr() != src.data_ptr():
        dst.copy_(src)


class DeviceStates(OptimizerStates):
    """``offload=none``. ``masters[g]`` is None when the parameters are fp32 (they are the master)."""

    def __init__(self, layouts: list[BufferLayout], param_piece: PieceOf, *, device: torch.device,
                 memory: MemoryTracker) -> None:
        super().__init__(layouts, memory)
        self.param_piece = param_piece
        self.masters: list[torch.Tensor | None] = []
        self.exp_avgs: list[torch.Tensor] = []
        self.exp_avg_sqs: list[torch.Tensor] = []
        for g, layout in enumerate(layouts):
            n = layout.shard_numel
            if layout.dtype == torch.float32:
                self.masters.append(None)
            else:
                master = torch.empty(n, dtype=torch.float32, device=device)
                for b in layout.buckets:
                    shard_slice(master, b).copy_(param_piece(g, b))
                self.masters.append(master)
            self.exp_avgs.append(torch.zeros(n, dtype=torch.float32, device=device))
            self.exp_avg_sqs.append(torch.zeros(n, dtype=torch.float32, device=device))
        memory.add("master_weights", sum(nbytes(m) for m in self.masters if m is not None))
        memory.add("optimizer_moments", sum(nbytes(t) for t in self.exp_avgs + self.exp_avg_sqs))

    def read_piece(self, group: int, bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        master = self.masters[group]
        return (self.param_piece(group, bucket) if master is None else shard_slice(master, bucket),
                shard_slice(self.exp_avgs[group], bucket), shard_slice(self.exp_avg_sqs[group], bucket))

    def write_piece(self, group: int, bucket: Bucket, master: torch.Tensor, exp_avg: torch.Tensor,
                    exp_avg_sq: torch.Tensor) -> None:
        for dst, src in zip(self.read_piece(group, bucket), (master, exp_avg, exp_avg_sq)):
            _copy_into(dst, src)

    def update_chunks(self, grad_piece: PieceOf, param_piece: PieceOf) -> Iterator[StateChunk]:
        for g, b in pieces(self.layouts):
            master, m, v = self.read_piece(g, b)
            yield StateChunk(g, b, 0, b.piece_size, master, m, v, grad_piece(g, b))
            if self.masters[g] is not None:
                param_piece(g, b).copy_(master)

    def device_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [m for m in self.masters if m is not None], self.exp_avgs + self.exp_avg_sqs
