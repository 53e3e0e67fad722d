"""Values for the few reads of tensor data a training step makes, while it runs on meta tensors.

A meta tensor has a shape and dtype but no data, so ``.item()`` / ``bool(t)`` (the loss, the
gradient norm, the overflow check) and ``torch.equal`` (the tied-embedding layout check against
the other pipeline end) have nothing to read. ``MetaValues`` answers them as a healthy step
would: a scalar read is 0 (a finite loss and norm); a truth value is that of the reduction
that made it, with every element healthy: ``all`` is True ("all finite") and ``any`` False ("no
bad target id"), any other bool False; and ``equal`` is True (the other end is not simulated here; its layout is the same code's). Every
other operator runs unchanged. Invariant: only operators on meta tensors are answered.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten


def _on_meta(args: tuple) -> bool:
    return any(isinstance(a, torch.Tensor) and a.device.type == "meta" for a in args)


class MetaValues(TorchDispatchMode):
    """``with MetaValues():`` data reads of meta tensors return a healthy step's values (module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0  # scalar reads answered
        # Results of all/any on meta tensors -> the truth value a healthy step gives them.
        # Keyed by id (a tensor's == is element-wise), with a weak reference to tell a reused id.
        self._truth: dict[int, tuple[weakref.ref, bool]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None) -> Any:
        kwargs = kwargs or {}
        if func is _aten._local_scalar_dense.default and _on_meta(args):
            self.reads += 1
            dtype = args[0].dtype
            if dtype == torch.bool:
                ref, value = self._truth.get(id(args[0]), (None, False))
                return value if ref is not None and ref() is args[0] else False
            return 0.0 if dtype.is_floating_point else 0
        if func is _aten.equal.default and _on_meta(args):
            return args[0].shape == args[1].shape and args[0].dtype == args[1].dtype
        out = func(*args, **kwargs)
        if func.overloadpacket in (_aten.all, _aten.any) and isinstance(out, torch.Tensor) and out.device.type == "meta":
            if len(self._truth) > 4096:  # drop the dead ones now and then
                self._truth = {k: v for k, v in self._truth.items() if v[0]() is not None}
            self._truth[id(out)] = (weakref.ref(out), func.overloadpacket is _aten.all)
        return out
