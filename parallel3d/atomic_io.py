"""Crash-safe file writes shared by the trainer's and ZeRO's checkpoints.

Invariant: a file at its final path is always complete — it is written under a
temporary name, flushed and fsynced, and only then renamed into place
(``os.replace`` is atomic on POSIX filesystems).
"""

from __future__ import annotations

import os
from typing import IO, Any, Callable

import torch


def fsync_dir(path: str) -> None:
    """Persist a directory's entries (new names, renames) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str, write: Callable[[IO[bytes]], Any]) -> None:
    """Call ``write(file)`` on ``path + '.part'``, fsync it, then rename it to ``path``."""
    part = path + ".part"
    with open(part, "wb") as fh:
        write(fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(part, path)


def atomic_torch_save(obj: Any, path: str) -> None:
    atomic_write_bytes(path, lambda fh: torch.save(obj, fh))
