"""How many bytes of activations a stage holds: storages autograd saves, counted once each.

``SavedBytes`` records, during one chunk forward, the tensors autograd saves for backward
(parameters excluded) and sums their storages, each storage once; the engine adds the
stage's stored input and output, and after a split backward's ``B`` it counts what the
weight-gradient queue holds instead (``held_bytes``). These are the numbers
``StepResult.peak_activation_bytes`` reports.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator

import torch

__all__ = ["SavedBytes", "held_bytes", "storage_key"]


def storage_key(t: torch.Tensor) -> int:
    """Identity of ``t``'s storage that survives a resize (ZeRO-3 frees and re-gathers parameter
    storage in place, which changes its data pointer but not the storage object)."""
    return t.untyped_storage()._cdata


def held_bytes(tensors: Iterable[torch.Tensor], exclude: set[int]) -> int:
    """Bytes of the distinct storages behind ``tensors``, leaving out the storage keys ``exclude``."""
    sizes = {storage_key(t): t.untyped_storage().nbytes() for t in tensors}
    return sum(n for k, n in sizes.items() if k not in exclude)


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


class SavedBytes:
    """Counts storage bytes autograd saves during one forward (parameters excluded).

    The pack hook only collects the tensors (it runs once per saved tensor, so it stays
    minimal); their storages are deduplicated and summed once, in ``total``/``storages``.
    """

    def __init__(self, param_storages: set[int]) -> None:
        self.param_storages = param_storages
        self._seen: list[torch.Tensor] = []  # not yet counted
        self._counted: dict[int, int] = {}

    def add(self, t: torch.Tensor) -> None:
        self._seen.append(t)

    @contextmanager
    def recording(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._seen.append(t)
        # A saved output returned as itself would hold its own grad_fn (tensor -> node -> saved
        # tensor): a cycle of C++ references no GC can see; a backward that never releases the
        # saved tensors (retain_graph) would leak every graph. A detached alias has no grad_fn.
        # (``is_leaf`` is ``grad_fn is None`` without making the node's Python object: this hook
        # runs for every saved tensor of every forward.)
        return t if t.is_leaf else t.detach()

    @property
    def storages(self) -> dict[int, int]:
        """storage key -> bytes of each non-parameter storage seen (tensors are dropped once counted)."""
        counted, params = self._counted, self.param_storages
        for t in self._seen:  # meta tensors too: a dry run's step measures its activations on meta
            storage = t.untyped_storage()  # once per tensor: each call makes a Python object
            key = storage._cdata  # storage_key's identity
            if key not in params and key not in counted:
                counted[key] = storage.nbytes()
        self._seen = []
        return counted

    @property
    def total(self) -> int:
        return sum(self.storages.values())
