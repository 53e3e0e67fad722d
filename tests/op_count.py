"""``OpCount``: a dispatch mode counting the aten ops run under it, for tests that pin what a code path runs.

Counts by overload packet, named ``aten.<op>`` (e.g. ``aten.mm``), every op dispatched while it is active,
those autograd's engine thread runs for a backward started under it included; each op runs unchanged.
"""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode


class OpCount(TorchDispatchMode):
    """``ops``: op name -> calls while the mode was active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket).replace("aten::", "aten.")] += 1
        return func(*args, **(kwargs or {}))
