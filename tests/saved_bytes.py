"""Bytes autograd saves for backward while a function runs (test helper).

Counted per storage (a tensor and its views count once, a view keeps its whole storage
alive), leaving out the storages of ``exclude`` (parameters, shared tables).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch


def saved_bytes(fn: Callable[[], Any], exclude: Iterable[torch.Tensor] = ()) -> tuple[int, Any]:
    """``(bytes saved for backward by fn(), fn's result)``."""
    excluded = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in excluded:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(storages.values()), out
