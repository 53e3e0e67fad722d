"""What one rank's optimizer owns, per parameter: the contract checkpoints are written against.

``owned_segments(opt)`` lists, for every run of this rank's optimizer shard that lies
inside one parameter, the parameter's layout-independent name and metadata, the flat
range of the (tp-local) parameter it covers, and in-place views of the fp32 master
weights and both Adam moments of that range. Checkpoint code reads and writes state
only through these views (and ``ZeroOptimizer.params_from_master`` afterwards), so it
never depends on how a ZeRO stage or an offload scheme stores its buffers: the views
come from ``ZeroOptimizer.read_state_piece`` (device tensors, host tensors with
``offload=cpu``, memory-mapped state files with ``offload=disk``, so a checkpoint of a
disk-offloaded run streams through the page cache instead of materialising the state),
and stage 3's master is this rank's parameter shard's source like in any other stage.

Invariants: the segments of one rank never overlap; the union of the segments over a
layout's replica group (``BufferLayout.reduce_kind``, dense: ``dp_cp``) covers every
element of every parameter of this model-parallel rank once (stages 1 and up) or on
every rank of that group (stage 0: the segment's ``replica_kind`` names the group).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from parallel3d.zero.buffers import Bucket, BufferLayout


class StateReader(Protocol):
    """What ``owned_segments`` reads of an optimizer (``ZeroOptimizer`` is one)."""

    layouts: list[BufferLayout]

    def read_state_piece(self, group: int, bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def layout_replicated(self, group: int) -> bool: ...


@dataclass(frozen=True)
class OwnedSegment:
    """Elements ``[start, start + length)`` of the flattened tp-local parameter ``name``."""

    name: str  # the parameter's global (layout-independent) name
    param: torch.nn.Parameter  # carries tp_split_dim / unpadded_rows / tied_embedding (param_meta)
    shape: tuple[int, ...]  # the tp-local parameter's shape
    start: int
    length: int
    master: torch.Tensor  # fp32 [length], a view: writing it changes the optimizer's state
    exp_avg: torch.Tensor  # fp32 [length]
    exp_avg_sq: torch.Tensor  # fp32 [length]
    replica_kind: str | None = None  # the group kind whose every rank holds this same segment (stage 0)

    def state(self, kind: str) -> torch.Tensor:
        """The view of ``kind``: ``"master"``, ``"exp_avg"`` or ``"exp_avg_sq"``."""
        return getattr(self, kind)


STATE_KINDS = ("master", "exp_avg", "exp_avg_sq")


def owned_segments(opt: StateReader) -> list[OwnedSegment]:
    """Every segment of ``opt``'s shard, in shard order (see module doc)."""
    out = []
    for g, layout in enumerate(opt.layouts):
        for b in layout.buckets:
            master, m, v = opt.read_state_piece(g, b)
            for seg in b.segments:
                lo, hi = seg.shard_start - b.shard_offset, seg.shard_end - b.shard_offset
                out.append(OwnedSegment(
                    name=seg.slot.name, param=seg.slot.param, shape=tuple(seg.slot.param.shape),
                    start=seg.param_start, length=seg.length,
                    master=master[lo:hi], exp_avg=m[lo:hi], exp_avg_sq=v[lo:hi],
                    replica_kind=layout.reduce_kind if opt.layout_replicated(g) else None,
                ))
    return out
