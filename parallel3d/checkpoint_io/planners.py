"""``torch.distributed.checkpoint`` planners over explicit pieces (``pieces.TensorPiece``).

DCP describes a tensor in a checkpoint as its global size plus the rectangular chunks
written by the ranks (``ChunkStorageMetadata``), and reads by intersecting the chunks a
rank wants with the chunks stored. DTensor and ShardedTensor produce such chunks from a
device mesh; ZeRO's pieces are not expressible that way, so these planners hand DCP the
chunks directly (the documented extension point: ``create_local_plan`` /
``resolve_data`` on save, ``create_local_plan`` / ``resolve_tensor`` on load).

On save, DCP's default global planning then checks that the chunks of every tensor
neither overlap nor leave a hole (so a wrong ownership rule fails the save loudly).
Byte objects (trainer state) travel as pickled ``BYTE_IO`` items written by one rank.
"""

from __future__ import annotations

import io
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from parallel3d.checkpoint_io.pieces import TensorPiece


class CheckpointMismatch(ValueError):
    """The checkpoint does not hold what this job needs (another model, missing state)."""


def _chunk(piece: TensorPiece) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(piece.box.offsets), sizes=torch.Size(piece.box.sizes))


class PieceSavePlanner(DefaultSavePlanner):
    """Writes ``pieces`` (each a chunk of its key's global tensor) and ``objects`` (pickled).

    ``failure``: this rank could not prepare its state (e.g. staging ran out of host memory);
    raised inside DCP's planning so that every rank fails the save instead of waiting."""

    def __init__(self, pieces: list[TensorPiece], objects: dict[str, Any], failure: BaseException | None = None) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = {(p.key, tuple(p.box.offsets)): p for p in pieces}
        self.duplicates = len(pieces) - len(self.pieces)
        self.objects = objects
        self.failure = failure

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.state_dict = state_dict  # unused: the pieces are the plan
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        # Raised here, inside DCP's planning step, so every rank sees the failure (no hang).
        if self.failure is not None:
            raise self.failure
        if self.duplicates:
            raise ValueError(f"{self.duplicates} pieces of this rank start at an element another piece starts at")
        items = []
        for (key, offsets), piece in self.pieces.items():
            props = TensorProperties(dtype=piece.data.dtype)
            items.append(WriteItem(
                index=MetadataIndex(key, torch.Size(offsets)), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=_chunk(piece), properties=props,
                                            size=torch.Size(piece.global_shape)),
            ))
        items += [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO) for key in self.objects]
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if write_item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save(self.objects[write_item.index.fqn], buf)
            buf.seek(0)
            return buf
        # A view; DCP copies it to compact host memory before serialising.
        return self.pieces[(write_item.index.fqn, tuple(write_item.index.offset))].data.detach()


class PieceLoadPlanner(DefaultLoadPlanner):
    """Reads into ``pieces`` (views) and loads the byte ``objects`` named in ``object_keys``.

    ``check`` (called with the checkpoint's metadata before planning, on every rank)
    raises ``CheckpointMismatch`` for a checkpoint of another model."""

    def __init__(self, pieces: list[TensorPiece], object_keys: tuple[str, ...] = ()) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.by_key: dict[str, list[TensorPiece]] = {}
        for p in pieces:
            self.by_key.setdefault(p.key, []).append(p)
        self.object_keys = object_keys
        self.objects: dict[str, Any] = {}

    def set_up_planner(self, state_dict, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        stored = self.metadata.state_dict_metadata
        check_pieces_match(self.by_key, stored, self.object_keys)
        requests: list[ReadItem] = []
        for key, pieces in self.by_key.items():
            requests += create_read_items_for_chunk_list(key, stored[key], [_chunk(p) for p in pieces])
        for key in self.object_keys:
            requests.append(ReadItem(
                type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(key), dest_offsets=torch.Size((0,)),
                storage_index=MetadataIndex(key), storage_offsets=torch.Size((0,)), lengths=torch.Size((0,)),
            ))
        return LoadPlan(requests)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # Our own trainer state (ints, strings, dicts), written by PieceSavePlanner.
        self.objects[read_item.dest_index.fqn] = torch.load(value, weights_only=False)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        piece = self.by_key[read_item.dest_index.fqn][read_item.dest_index.index]
        return narrow_tensor_by_index(piece.data, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # resolve_tensor returned a view of the destination: the data is in place


def check_pieces_match(by_key: dict[str, list[TensorPiece]], stored: dict, object_keys: tuple[str, ...]) -> None:
    """Raise ``CheckpointMismatch`` (one line) when a wanted key is absent or has another shape."""
    missing = sorted(k for k in list(by_key) + list(object_keys) if k not in stored)
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise CheckpointMismatch(f"the checkpoint has no {', '.join(missing[:3])}{more}")
    for key, pieces in by_key.items():
        md = stored[key]
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointMismatch(f"{key} is not a tensor in the checkpoint")
        want = tuple(pieces[0].global_shape)
        if tuple(md.size) != want:
            raise CheckpointMismatch(f"{key} has shape {list(md.size)} in the checkpoint but {list(want)} in this model")
    for key in object_keys:
        if not isinstance(stored[key], BytesStorageMetadata):
            raise CheckpointMismatch(f"{key} is not an object in the checkpoint")
