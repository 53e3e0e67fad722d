"""Stages 1-2: the parameter all-gather after ``step()`` overlapped with the next forward.

After the optimizer has written this rank's updated piece of every bucket, the
buckets must be all-gathered over their layout's replica group (``reduce_kind``)
before anyone reads the parameters. Instead
of waiting at the end of ``step()``, ``ParamGatherOverlap.start`` launches one
async all-gather per bucket, in forward order (the order the next forward needs
them), and returns; each bucket is waited for just before the first module that
reads it runs its forward (a forward pre-hook), as Megatron's overlapped
parameter gather does.

Who waits (the invariant: nothing reads a parameter of a bucket still in flight):
- forward pre-hooks on the gather units of ``units.find_units`` (transformer
  blocks, untied embedding / head, and each chunk's root, which holds every
  parameter read outside its own module's forward, e.g. a tied head weight):
  a unit's hook waits for every bucket holding one of its parameters. The root's
  hook runs before any of the chunk's layers, so the contract of ``units``
  (a unit's parameters are read only inside the unit's forward) is exactly what
  makes this exact;
- ``wait_all`` for every other reader: ``ZeroOptimizer.finish_param_sync`` (the
  next ``step()``, checkpoint state pieces, ``gathered_params``, HF export,
  ``params_from_master``, the end of training) and a ``state_dict`` pre-hook on
  each chunk.

Stream semantics: on NCCL ``work.wait()`` makes the current stream wait for the
collective, so the forward kernels queued after the hook are ordered after the
gather without blocking the host; on gloo it blocks until the data has arrived.
NCCL gathers in place (the piece is the rank's slice of the output, which NCCL
supports). gloo gathers in place by point-to-point messages
(``comm.all_gather_exchange``: the piece goes from the bucket to every peer and theirs
arrive in their slots, no copy); gloo's own all-gather would need a copy of the piece
as its input and gathers into a temporary it then copies out (on a 2-core machine
those copies compete with the other rank's forward). Other backends (the dry run's
fake one) send a copy of the piece, kept alive until the work is waited for.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from parallel3d import comm
from parallel3d.parallel_state import ParallelState
from parallel3d.zero.buffers import FlatBuffer
from parallel3d.zero.units import GatherUnit

Key = tuple[int, int]  # (group, bucket index)
PARAM_GATHER_TAG = 0x9A7  # gloo's point-to-point gathers: apart from any other message between the same ranks


def launch_gather(buf: FlatBuffer, bucket: Any, pstate: ParallelState) -> tuple[Any, torch.Tensor | None]:
    """Start the async all-gather of ``bucket``'s pieces into the bucket over ``buf``'s replica group;
    returns (work, source). In place on NCCL and gloo (module doc); otherwise the source is a copy of
    the piece, which must stay alive until the work is waited for."""
    if pstate.backend == "gloo":  # every group of a ParallelState has its backend
        return comm.all_gather_exchange(buf.bucket_view(bucket), pstate, buf.layout.reduce_kind,
                                        tag=PARAM_GATHER_TAG), None
    src = buf.piece_view(bucket) if pstate.backend == "nccl" else buf.piece_view(bucket).clone()
    return comm.all_gather_into_tensor(buf.bucket_view(bucket), src, pstate, buf.layout.reduce_kind,
                                       async_op=True), src


class ParamGatherOverlap:
    """Async per-bucket all-gathers of ``bufs`` over their replica groups, each waited for by the first
    unit reading it."""

    def __init__(self, bufs: list[FlatBuffer], units: list[GatherUnit], pstate: ParallelState) -> None:
        self.bufs, self.pstate = bufs, pstate
        where: dict[int, Key] = {}
        for g, buf in enumerate(bufs):
            for b in buf.layout.buckets:
                for s in b.slots:
                    where[id(s.param)] = (g, b.index)
        # Buckets each unit reads, and every bucket once in the order units run forward
        # (roots first, then layers), so the first gathers launched are the first needed.
        self.unit_buckets: dict[int, list[Key]] = {}
        self.launch_order: list[Key] = []
        seen: set[Key] = set()
        for u in units:
            keys = sorted({where[id(p)] for p in u.params if id(p) in where}, key=lambda k: (k[0], -k[1]))
            self.unit_buckets[u.index] = keys
            for k in keys:
                if k not in seen:
                    seen.add(k)
                    self.launch_order.append(k)
        for g, buf in enumerate(bufs):  # buckets of no unit (cannot happen for chunk parameters) go last
            for b in buf.layout.buckets:
                if (g, b.index) not in seen:
                    self.launch_order.append((g, b.index))
        self._pending: dict[Key, tuple[Any, torch.Tensor | None]] = {}
        self._handles = []
        for u in units:
            self._handles.append(u.module.register_forward_pre_hook(partial(self._before_forward, u.index)))
        for chunk in {id(u.module): u.module for u in units if u.is_root}.values():
            self._handles.append(chunk.register_state_dict_pre_hook(self._before_state_dict))

    @property
    def pending(self) -> int:
        """Buckets whose gather is in flight."""
        return len(self._pending)

    @torch.no_grad()
    def start(self) -> None:
        """Launch every bucket's all-gather (the pieces are final); nothing waits here."""
        self.wait_all()  # a bucket is never gathered twice at once
        for g, i in self.launch_order:
            buf = self.bufs[g]
            work, src = launch_gather(buf, buf.layout.buckets[i], self.pstate)
            if work is not None:
                self._pending[(g, i)] = (work, src)

    def wait(self, keys: list[Key]) -> None:
        for key in keys:
            entry = self._pending.pop(key, None)
            if entry is not None:
                entry[0].wait()

    def wait_all(self) -> None:
        """Finish every gather in flight (launch order)."""
        if self._pending:
            self.wait([k for k in self.launch_order if k in self._pending])

    def _before_forward(self, unit: int, module: torch.nn.Module, args: Any) -> None:
        if self._pending:
            self.wait(self.unit_buckets[unit])

    def _before_state_dict(self, module: torch.nn.Module, prefix: str, keep_vars: bool) -> None:
        self.wait_all()

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
