"""Read back what a W&B run wrote to its offline ``run-<id>.wandb`` file.

wandb (0.31) has no public reader for this file. Its framing, read from the
files it writes, is LevelDB's log format: a 7-byte header (``:W&B``, magic
0xBEE1 little-endian, version 0), then 32 KiB blocks of chunks, each
``crc32 (uint32 LE) | length (uint16 LE) | type (uint8) | payload``, where the
CRC is zlib's crc32 over the type byte and the payload, and a type says whether
the chunk is a whole record (1) or the first (2), a middle (3) or the last (4)
piece of one that spans blocks; a block tail shorter than a chunk header is
zero padding. Each reassembled record is a ``wandb_internal_pb2.Record``.

This is wandb's internal format and may change between versions; it is used by
the tests and for debugging, never by training.
"""

from __future__ import annotations

import glob
import json
import os
import struct
import time
import zlib
from typing import Any, Iterator

MAGIC = b":W&B"
HEADER = struct.Struct("<4sHB")  # ident, magic, version
CHUNK = struct.Struct("<IHB")  # crc, length, type
BLOCK_SIZE = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


class WandbFileError(ValueError):
    """The file is not a W&B transaction log this reader understands."""


def iter_record_bytes(path: str) -> Iterator[bytes]:
    """The serialized records of one .wandb file, in write order."""
    with open(path, "rb") as fh:
        data = fh.read()
    if len(data) < HEADER.size:
        raise WandbFileError(f"{path}: too short for a W&B header")
    ident, magic, version = HEADER.unpack_from(data, 0)
    if ident != MAGIC or magic != 0xBEE1 or version != 0:
        raise WandbFileError(f"{path}: not a W&B log (ident={ident!r}, magic={magic:#x}, version={version})")
    pos = HEADER.size
    pending: list[bytes] = []
    while pos + CHUNK.size <= len(data):
        left_in_block = BLOCK_SIZE - pos % BLOCK_SIZE
        if left_in_block < CHUNK.size:
            pos += left_in_block  # zero padding at a block's end
            continue
        crc, length, kind = CHUNK.unpack_from(data, pos)
        if crc == 0 and length == 0 and kind == 0:
            pos += left_in_block  # rest of a block that was never filled
            continue
        payload = data[pos + CHUNK.size : pos + CHUNK.size + length]
        if len(payload) < length:
            break  # truncated tail of a run that is still being written
        if zlib.crc32(bytes([kind]) + payload) != crc:
            raise WandbFileError(f"{path}: CRC mismatch at byte {pos}")
        pos += CHUNK.size + length
        if kind == FULL:
            yield payload
        elif kind == FIRST:
            pending = [payload]
        elif kind == MIDDLE:
            pending.append(payload)
        elif kind == LAST:
            pending.append(payload)
            yield b"".join(pending)
            pending = []
        else:
            raise WandbFileError(f"{path}: unknown chunk type {kind} at byte {pos}")


def iter_records(path: str) -> Iterator[Any]:
    """Parsed ``wandb_internal_pb2.Record`` messages of one .wandb file."""
    from wandb.proto import wandb_internal_pb2

    for raw in iter_record_bytes(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        yield record


def _item_key(item: Any) -> str:
    return item.key if item.key else "/".join(item.nested_key)


def read_run(path: str, wait_s: float = 0.0) -> dict[str, Any]:
    """``{"history": [row, ...], "config": {...}, "summary": {...}, "complete": bool}`` of one .wandb file.

    W&B's writer is a separate service process that may still be flushing after
    ``run.finish()`` returns; ``wait_s`` > 0 re-reads until the run's exit record is
    in the file (``complete``) or that many seconds have passed.
    """
    deadline = time.monotonic() + wait_s
    while True:
        try:
            run = _read_once(path)
        except Exception:  # a record still being written; give up only at the deadline
            if time.monotonic() >= deadline:
                raise
        else:
            if run["complete"] or time.monotonic() >= deadline:
                return run
        time.sleep(0.2)


def _read_once(path: str) -> dict[str, Any]:
    history: list[dict[str, Any]] = []
    config: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    complete = False
    for record in iter_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "exit":
            complete = True
        elif kind == "history":
            history.append({_item_key(i): json.loads(i.value_json) for i in record.history.item})
        elif kind == "config":
            for item in record.config.update:
                config[_item_key(item)] = json.loads(item.value_json)
        elif kind == "summary":
            for item in record.summary.update:
                summary[_item_key(item)] = json.loads(item.value_json)
        elif kind == "run":
            for item in record.run.config.update:
                config[_item_key(item)] = json.loads(item.value_json)
    return {"history": history, "config": config, "summary": summary, "complete": complete}


def find_offline_runs(root: str) -> list[str]:
    """The .wandb files of offline runs under ``root`` (W&B writes ``root/wandb/offline-run-*``)."""
    return sorted(glob.glob(os.path.join(root, "wandb", "offline-run-*", "run-*.wandb")))
