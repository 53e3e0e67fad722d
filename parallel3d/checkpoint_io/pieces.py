"""Which boxes of which global tensors this rank writes and reads, as views of its optimizer state.

Keys (the same at every layout; values are fp32 and have the parameter's whole, unpadded
shape; ``<name>`` is the parameter's ``global_name``; routed experts are named by their
GLOBAL expert index, ``layers.<i>.mlp.experts.<e>.w1``, whatever ep rank holds them):

    model.<name>               the weights: fp32 master weights (bf16/fp16 parameters are their
                               rounding, so both are restored exactly), the parameters in fp32
    optim.exp_avg.<name>       Adam's first moment
    optim.exp_avg_sq.<name>    Adam's second moment
    buffer.<module>.<buffer>   a module's persistent buffer (the router's ``expert_bias``), whole;
                               ``<module>`` is the module's global prefix (its parameters' names)

Where a parameter's local tensor sits in the global one: ``param_meta.shard_grid`` (the one
source): chunk ``coord(kind)`` along ``dim`` of the group ``kind``, ``tp`` for dense
parameters, ``etp`` for routed experts (their own grid, so etp may differ from tp).

Who writes what: every element is written exactly once in the job. A rank writes its
optimizer segments (``ZeroOptimizer.owned_segments``) mapped to global boxes
(``boxes``), except that copies are split among their holders: a parameter replicated
over its grid's group (``dim`` None: norms, row-parallel biases over tp) is written in as many
equal flat parts as that group has ranks (part ``coord(kind)``), stage-0 state (replicated
over the segment's ``replica_kind`` group: ``dp_cp``, experts ``edp``) in as many parts as that
group has ranks, and the head's copy of a tied embedding is not written (the embedding's is the
same). Buffers are equal on every rank holding their module (they are updated from global
statistics), so the rank at coordinate 0 of tp, cp and dp writes them. Readers take every box
they hold, copies included.
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
BUFFER_PREFIX = "buffer."
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


def _grid(param: torch.Tensor, pstate: "ParallelState") -> tuple[int | None, int, int]:
    """``(split dim, number of chunks, this rank's chunk)`` of ``param``'s grid (``param_meta.shard_grid``)."""
    kind, dim = param_meta.shard_grid(param)
    return dim, pstate.size(kind), pstate.coord(kind)


def _global_shape(seg: OwnedSegment, pstate: "ParallelState") -> tuple[int, ...]:
    dim, size, _ = _grid(seg.param, pstate)
    return global_shape(seg.shape, dim, size, getattr(seg.param, "unpadded_rows", None))


def held_box(param: torch.Tensor, pstate: "ParallelState") -> Box | None:
    """The box of the global (unpadded) tensor that this rank's ``param`` holds (its leading
    ``box.sizes`` of every dimension; the rest is vocabulary padding); None: padding only.
    ``param`` must be whole (under ZeRO-3: inside ``ZeroOptimizer.gathered_params``)."""
    dim, _, index = _grid(param, pstate)
    whole = Box((0,) * param.ndim, tuple(param.shape), 0)
    return to_global(whole, tuple(param.shape), dim, index, getattr(param, "unpadded_rows", None))


def _pieces(seg: OwnedSegment, lo: int, hi: int, pstate: "ParallelState", kinds: tuple[str, ...]) -> list[TensorPiece]:
    """Pieces of elements ``[lo, hi)`` of ``seg``'s parameter, one set per state kind."""
    split, _, index = _grid(seg.param, pstate)
    rows = getattr(seg.param, "unpadded_rows", None)
    shape = _global_shape(seg, pstate)
    out = []
    for local in flat_range_boxes(seg.shape, lo, hi):
        box = to_global(local, seg.shape, split, index, rows)
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
    split, size, coord = _grid(seg.param, pstate)
    if split is None:  # the same values on every rank of the grid's group
        copies, index = size, coord
    if seg.replica_kind is not None:
        holders = pstate.ranks(seg.replica_kind)
        copies, index = copies * len(holders), index * len(holders) + holders.index(pstate.rank)
    lo = seg.start + seg.length * index // copies
    hi = seg.start + seg.length * (index + 1) // copies
    return (lo, hi) if hi > lo else None


def buffer_pieces(opt: "ZeroOptimizer") -> list[TensorPiece]:
    """Every persistent buffer of this rank's modules, whole, keyed by its module's global prefix.

    The prefix comes from one of the module's own parameters (``global_name`` ends with its local
    name); a module without one has no layout-free name, so a buffer there is an error, not a skip."""
    out = []
    for chunk in opt.modules:
        for module in chunk.modules():
            buffers = [(n, b) for n, b in module.named_buffers(recurse=False)
                       if b is not None and n not in module._non_persistent_buffers_set]
            if not buffers:
                continue
            named = [(n, p.global_name) for n, p in module.named_parameters(recurse=False) if hasattr(p, "global_name")]
            if not named or not named[0][1].endswith("." + named[0][0]):
                raise ValueError(f"a {type(module).__name__} has buffers {[n for n, _ in buffers]} but no parameter "
                                 "with a global_name to name them by in checkpoints")
            prefix = named[0][1][: -len(named[0][0]) - 1]
            for name, buf in buffers:
                shape = tuple(buf.shape)
                out.append(TensorPiece(f"{BUFFER_PREFIX}{prefix}.{name}", shape, Box((0,) * len(shape), shape, 0), buf))
    return out


def _writes_buffers(pstate: "ParallelState") -> bool:
    """One rank of each pipeline stage writes the stage's buffers (they are equal on all its ranks)."""
    return all(pstate.coord(d) == 0 for d in ("tp", "cp", "dp"))


def pieces_to_write(opt: "ZeroOptimizer", pstate: "ParallelState") -> list[TensorPiece]:
    """This rank's share of the job's state, as views (see module doc)."""
    out = []
    for seg in opt.owned_segments():
        part = _written_part(seg, pstate)
        if part is not None:
            out += _pieces(seg, *part, pstate, STATE_KINDS)
    return out + (buffer_pieces(opt) if _writes_buffers(pstate) else [])


def pieces_to_read(opt: "ZeroOptimizer", pstate: "ParallelState", *, weights_only: bool = False) -> list[TensorPiece]:
    """Every box this rank holds, as views to load into (``weights_only``: the master weights only)."""
    kinds = WEIGHTS_ONLY if weights_only else STATE_KINDS
    out = []
    for seg in opt.owned_segments():
        out += _pieces(seg, seg.start, seg.start + seg.length, pstate, kinds)
    return out if weights_only else out + buffer_pieces(opt)


def zero_owned_state(opt: "ZeroOptimizer", *, weights_only: bool = False) -> None:
    """Zero what a load will overwrite, so vocabulary padding (never stored) ends up zero."""
    kinds = WEIGHTS_ONLY if weights_only else STATE_KINDS
    with torch.no_grad():
        for seg in opt.owned_segments():
            for kind in kinds:
                seg.state(kind).zero_()
