"""Checksums of a checkpoint's files: written into ``meta.json`` at commit, verified on resume.

``meta.json`` lists every file with its size (``file_bytes``) and CRC-32 (``file_crc32``).
Both sides are spread over the ranks (rank r handles files ``r, r + world, ...`` of the sorted
list), so neither the save's commit nor a resume reads the whole checkpoint on one rank;
the per-rank results are exchanged with ``all_gather_object`` on the caller's group.

``damage(directory, meta, files)`` names the first damaged file of ``files``: missing,
truncated or grown (size), or corrupted (CRC-32); checkpoints written before checksums
existed are checked by size only.
"""

from __future__ import annotations

import os
import zlib
from typing import Any

import torch.distributed as dist

CHUNK = 8 << 20


def crc32_of(path: str) -> int:
    crc = 0
    with open(path, "rb") as fh:
        while True:
            block = fh.read(CHUNK)
            if not block:
                return crc
            crc = zlib.crc32(block, crc)


def my_share(files: list[str], rank: int, world: int) -> list[str]:
    return sorted(files)[rank::world]


def gather(value: Any, world: int, group: "dist.ProcessGroup | None") -> list[Any]:
    """Every rank's ``value`` (collective over ``group``, or the default group; local in one process)."""
    if world == 1 or not dist.is_initialized():
        return [value]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, value, group=group)
    return out


def damage(directory: str, meta: dict[str, Any], files: list[str]) -> str | None:
    """``'<path>: <what is wrong>'`` for the first damaged file of ``files``, or None."""
    sizes, crcs = meta.get("file_bytes", {}), meta.get("file_crc32", {})
    for f in files:
        path = os.path.join(directory, f)
        if not os.path.isfile(path):
            return f"{path}: missing"
        size = os.path.getsize(path)
        if f in sizes and size != sizes[f]:
            return f"{path}: {'truncated' if size < sizes[f] else 'grown'} to {size} bytes (saved with {sizes[f]})"
    for f in files:
        if f in crcs:
            path = os.path.join(directory, f)
            try:
                got = crc32_of(path)
            except OSError as exc:
                return f"{path}: unreadable ({exc})"
            if got != crcs[f]:
                return f"{path}: corrupted (CRC-32 {got:08x}, saved with {crcs[f]:08x})"
    return None
