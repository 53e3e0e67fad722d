"""How many bytes of activations a stage holds: storages autograd saves, counted once each.

``SavedBytes`` records, during one chunk forward, the tensors autograd saves for backward
(parameters excluded) and sums their storages, each storage once; the engine adds the
stage's stored input and output, and after a split backward's ``B`` it counts what the
weight-gradient queue holds instead (``held_bytes``). These are the numbers
``StepResult.peak_activation_bytes`` reports.

The hooks cost a Python call per saved tensor, so the engine records only on steps that
ask for the numbers (``run_step(account_activations=True)``). On the others
``output_saved`` answers the one question the engine cannot skip (may a sent output's
storage be freed?) from the output tensor alone.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator

import torch

__all__ = ["SavedBytes", "held_bytes", "output_saved", "storage_key"]


def storage_key(t: torch.Tensor) -> int:
    """Identity of ``t``'s storage that survives a resize (ZeRO-3 frees and re-gathers parameter
    storage in place, which changes its data pointer but not the storage object)."""
    return t.untyped_storage()._cdata


def held_bytes(tensors: Iterable[torch.Tensor], exclude: set[int]) -> int:
    """Bytes of the distinct storages behind ``tensors``, leaving out the storage keys ``exclude``."""
    sizes = {storage_key(t): t.untyped_storage().nbytes() for t in tensors}
    return sum(n for k, n in sizes.items() if k not in exclude)


def output_saved(out: torch.Tensor) -> bool:
    """Whether autograd may have saved ``out``'s storage for backward (True unless proven not).

    Read right after the forward that returned ``out``, with no saved-tensor hooks active.
    Chunk contract (``models.transformer`` keeps it): ``out`` is the forward's last result,
    no op recorded after it takes it as input. Then only its producer (``out.grad_fn``) or
    an earlier node that saved a tensor sharing its storage can hold it, and:

    * a torch node saves its own result as a *new* TensorImpl on the storage
      (``SavedVariable(result, is_output=True)`` keeps ``tensor_data()``, to avoid a cycle),
      and any earlier tensor sharing the storage (a base ``out`` views, a saved view) is one
      more TensorImpl too. So one user of the storage, ``out`` itself, proves neither happened.
    * a custom ``autograd.Function`` may also keep ``out`` on its ctx as a plain attribute,
      the same TensorImpl (no extra use): its ctx's tensors are compared by storage.

    * under saved-tensor hooks the pack hook decides what is kept: unproven.

    Anything unproven answers True: a wrong True only keeps a storage that could go; a
    wrong False would free what backward reads.
    """
    node = out.grad_fn
    if node is None:  # a leaf or an input passed through: its owner keeps it anyway
        return True
    # Under saved-tensor hooks (the caller's, e.g. offloading) autograd keeps whatever the pack
    # hook returned, which may be ``out`` itself: no extra use to see. (Called in the scope the
    # forward ran in; hooks a chunk installs inside its forward, e.g. checkpoint's, are over.)
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        return True
    storage = out.untyped_storage()
    # 2 = out's TensorImpl + the ``storage`` wrapper just made: no other tensor on the storage.
    if torch._C._storage_Use_Count(storage._cdata) != 2:
        return True
    if isinstance(node, torch.autograd.function.BackwardCFunction):
        key = storage._cdata
        held = [*node.saved_tensors, *vars(node).values()]
        for value in held:
            items = value if isinstance(value, (tuple, list)) else (value,)
            if any(isinstance(t, torch.Tensor) and storage_key(t) == key for t in items):
                return True
    return False


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
