"""Writing and reading layout-free state with ``torch.distributed.checkpoint`` (DCP).

``write_state`` / ``read_state`` are collective over ``group`` (a gloo group spanning the
job, or None in a single process): every rank writes its pieces (``pieces.pieces_to_write``)
into one DCP directory (``.metadata`` + one ``__<rank>_0.distcp`` file per rank) and reads
the boxes it needs from whichever files hold them. Neither is atomic on its own: the
checkpoint directory protocol (``parallel3d.checkpoint``) makes a save visible only after
every rank succeeded. A failure on one rank raises on every rank (DCP exchanges failures
in its collectives), as one line naming the rank and the cause.

``read_tensors`` reads whole tensors in one process (export, inspection, tests).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from parallel3d.checkpoint_io.boxes import Box
from parallel3d.checkpoint_io.pieces import TensorPiece
from parallel3d.checkpoint_io.planners import CheckpointMismatch, PieceLoadPlanner, PieceSavePlanner
from parallel3d.faults import inject


class _FileWriter(FileSystemWriter):
    """DCP's file writer with the ``checkpoint.write`` fault point (``parallel3d.faults``) inside
    its write step, where DCP exchanges a failure with every rank."""

    def __init__(self, directory: str, rank: int) -> None:
        super().__init__(directory, single_file_per_rank=True, sync_files=True)
        self.rank = rank

    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        inject("checkpoint.write", self.rank)
        return super().write_data(plan, planner)


class StateIOError(RuntimeError):
    """A DCP save or load failed on some rank; the message is one line."""


def _one_line(exc: CheckpointException) -> BaseException:
    """The first rank's cause, as a CheckpointMismatch when it is one (else a StateIOError)."""
    for rank, (cause, _) in sorted(exc.failures.items()):
        if isinstance(cause, CheckpointMismatch):
            return CheckpointMismatch(str(cause))
        first = f"rank {rank}: {type(cause).__name__}: {cause}"
        return StateIOError(first.splitlines()[0] if first else "checkpoint I/O failed")
    return StateIOError("checkpoint I/O failed")


def write_state(directory: str, pieces: list[TensorPiece], objects: dict[str, Any],
                group: "dist.ProcessGroup | None", failure: BaseException | None = None) -> None:
    """Collective: write ``pieces`` and the picklable ``objects`` of every rank into ``directory``.

    A rank passing ``failure`` (it could not prepare its pieces) still takes part, and the
    save fails on every rank with that cause."""
    writer = _FileWriter(directory, dist.get_rank() if group is not None else 0)
    try:
        planner = PieceSavePlanner(pieces, objects, failure)
    except Exception as exc:  # noqa: BLE001 - raised here, the peers would wait for this rank in DCP's collectives
        planner = PieceSavePlanner([], {}, exc)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save({}, storage_writer=writer, planner=planner, process_group=group, no_dist=group is None)
    except CheckpointException as exc:
        raise _one_line(exc) from None


def read_state(directory: str, pieces: list[TensorPiece], object_keys: tuple[str, ...],
               group: "dist.ProcessGroup | None") -> dict[str, Any]:
    """Collective: fill every piece's ``data`` from ``directory``; returns the named objects.

    Raises ``CheckpointMismatch`` (on every rank) when a key is missing or has another shape.
    """
    planner = PieceLoadPlanner(pieces, object_keys)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({}, storage_reader=FileSystemReader(directory), planner=planner, process_group=group,
                     no_dist=group is None)
    except CheckpointException as exc:
        raise _one_line(exc) from None
    return planner.objects


def read_metadata(directory: str) -> Metadata:
    """The DCP metadata of ``directory`` (keys, global shapes, chunks)."""
    return FileSystemReader(directory).read_metadata()


def read_tensors(directory: str, keys: list[str], metadata: Metadata | None = None,
                 dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Whole tensors ``keys`` of ``directory``, read in this process only (no collectives)."""
    metadata = metadata or read_metadata(directory)
    stored = metadata.state_dict_metadata
    out, pieces = {}, []
    for key in keys:
        if key not in stored or not hasattr(stored[key], "size"):
            raise CheckpointMismatch(f"the checkpoint {directory} has no tensor {key}")
        md = stored[key]
        shape = tuple(md.size)
        out[key] = torch.empty(shape, dtype=md.properties.dtype)
        pieces.append(TensorPiece(key, shape, Box((0,) * len(shape), shape, 0), out[key]))
    read_state(directory, pieces, (), None)
    if dtype is not None:
        out = {k: v.to(dtype) for k, v in out.items()}
    return out
