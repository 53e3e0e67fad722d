"""Which boxes of which global tensors this rank writes and reads, as views of its optimizer state.

Keys (the same at every layout; values are fp32 and have the parameter's whole, unpadded
shape; ``<name>`` is the parameter's ``global_name``):

    model.<name>               the weights: fp32 master weights (bf16/fp16 parameters are their
                               rounding, so both are restored exactly), the parameters in fp32
    optim.exp_avg.<name>       Adam's first moment
    optim.exp_avg_sq.<name>    Adam's second moment

Who writes what: every element is written exactly once in the job. A rank writes its
optimizer segments (``ZeroOptimizer.owned_segments``) mapped to global boxes
(``boxes``), except that copies are split among their holders: a parameter replicated
over tp is written in ``tp`` equal flat parts (part ``tp_rank``), stage-0 state (replicated
over the segment's ``replica_kind`` group, ``dp_cp``) in as many parts as that group has ranks, and the head's copy of a tied
embedding is not written (the embedding's is the same). Readers take every box they hold, copies included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from parallel3d import param_meta
from parallel3d.checkpoint_io.boxes import Box, flat_range_boxes, global_shape, to_global
from parallel3d.zero.owned import STATE_KINDS, OwnedSegment

if TYPE_CHECKING:  # pragma: no cover
    from parallel3d.parallel_state import ParallelState
    from parallel3d.zero.optimizer import ZeroOptimizer

KEY_PREFIX = {"master": "model.", "exp_avg": "optim.exp_avg.", "exp_avg_sq": "optim.exp_avg_sq."}
WEIGHTS_ONLY = ("master",)


@dataclass(frozen=True)
class TensorPiece:
    """A box of the global tensor ``key`` whose values live in ``data`` (shape ``box.sizes``)."""

    key: str
    global_shape: tuple[int, ...]
    box: Box
    data: torch.Tensor  # a view into the optimizer's state (or a staged host copy of it)


def key_of(kind: str, name: str) -> str:
    return KEY_PREFIX[kind] + name


def _global_shape(seg: OwnedSegment, pstate: "ParallelState") -> tuple[int, ...]:
    return global_shape(seg.shape, param_meta.tp_split_dim(seg.param), pstate.size("tp"),
                        getattr(seg.param, "unpadded_rows", None))


def _pieces(seg: OwnedSegment, lo: int, hi: int, pstate: "ParallelState", kinds: tuple[str, ...]) -> list[TensorPiece]:
    """Pieces of elements ``[lo, hi)`` of ``seg``'s parameter, one set per state kind."""
    split = param_meta.tp_split_dim(seg.param)
    rows = getattr(seg.param, "unpadded_rows", None)
    shape = _global_shape(seg, pstate)
    out = []
    for local in flat_range_boxes(seg.shape, lo, hi):
        box = to_global(local, seg.shape, split, pstate.coord("tp"), rows)
        if box is None or box.numel == 0:
            continue
        first = lo - seg.start + local.flat_start  # position of the box's data in the segment
        for kind in kinds:
            data = seg.state(kind)[first : first + box.numel].view(box.sizes)
            out.append(TensorPiece(key_of(kind, seg.name), shape, box, data))
    return out


def _written_part(seg: OwnedSegment, pstate: "ParallelState") -> tuple[int, int] | None:
    """The flat range of ``seg`` this rank writes (its share among the segment's copies)."""
    if param_meta.is_tied_head_copy(seg.param):
        return None  # the embedding's copy of a tied embedding is the one written
    copies, index = 1, 0
    if param_meta.tp_split_dim(seg.param) is None:
        copies, index = pstate.size("tp"), pstate.coord("tp")
    if seg.replica_kind is not None:
        holders = pstate.ranks(seg.replica_kind)
        copies, index = copies * len(holders), index * len(holders) + holders.index(pstate.rank)
    lo = seg.start + seg.length * index // copies
    hi = seg.start + seg.length * (index + 1) // copies
    return (lo, hi) if hi > lo else None


def pieces_to_write(opt: "ZeroOptimizer", pstate: "ParallelState") -> list[TensorPiece]:
    """This rank's share of the job's state, as views (see module doc)."""
    out = []
    for seg in opt.owned_segments():
        part = _written_part(seg, pstate)
        if part is not None:
            out += _pieces(seg, *part, pstate, STATE_KINDS)
    return out


def pieces_to_read(opt: "ZeroOptimizer", pstate: "ParallelState", *, weights_only: bool = False) -> list[TensorPiece]:
    """Every box this rank holds, as views to load into (``weights_only``: the master weights only)."""
    kinds = WEIGHTS_ONLY if weights_only else STATE_KINDS
    out = []
    for seg in opt.owned_segments():
        out += _pieces(seg, seg.start, seg.start + seg.length, pstate, kinds)
    return out


def zero_owned_state(opt: "ZeroOptimizer", *, weights_only: bool = False) -> None:
    """Zero what a load will overwrite, so vocabulary padding (never stored) ends up zero."""
    kinds = WEIGHTS_ONLY if weights_only else STATE_KINDS
    with torch.no_grad():
        for seg in opt.owned_segments():
            for kind in kinds:
                seg.state(kind).zero_()
