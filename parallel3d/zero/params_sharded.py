"""ZeRO stage 3: each DP rank keeps only its shard of the parameters; units are gathered just in time.

Residency. Parameters use ``buffers``' bucket layout with buckets aligned to
gather units (``units``), so a unit's parameters are whole buckets. This rank
keeps ``shards[g]``: its pieces of every bucket, in the model dtype and in shard
coordinates (Ψ/N elements, the optimizer's coordinates too). Every bucket also
has a full-size tensor whose *storage* is freed (resized to 0 bytes) while the
bucket is released, and re-allocated and all-gathered from the DP group when it
is needed. Parameters are views of these tensors all the time, so tensors
autograd saved from a parameter read the re-gathered values in backward.

When a unit is whole (``reshard``):
- ``microbatch`` (``auto`` with pp == 1; FSDP's reshard-after-forward): gathered
  right before each forward of the unit and released right after it; gathered
  again by a hook on the unit's outputs right before its backward, released when
  its last parameter gradient has been consumed. A chunk's root unit stays whole
  from its forward to the end of its backward (which starts with it). Two
  all-gathers per unit and microbatch.
- ``step`` (``auto`` with pp > 1): gathered at first use in the step, kept until
  the unit's last backward of the step (the one after ``prepare(True)``). 1F1B and
  interleaved schedules run the forwards and backwards of many microbatches out of
  order; gathering per microbatch would cost 2m all-gathers per unit and step, so a
  stage keeps its (already 1/pp) parameters whole through the step, as FSDP is used
  with pipelining. One all-gather per unit per step; inside the step the weights
  cost what they cost in stage 2, between steps Ψ/N.

Backwards interleave. Zero-bubble schedules split a backward in two (``B``: input and
undeferred weight gradients; ``W``: the deferred weight gradients) and may run several
microbatches' ``B`` before their ``W`` and forwards in between, so "every parameter has
had one gradient" does not mark the end of one backward. A unit counts gradients per
parameter instead: its k-th backward is complete once every parameter has had k gradients
(each parameter's gradients arrive in microbatch order). ``microbatch`` releases a unit
when its backwards so far are all complete (no ``B`` waiting for its ``W``); ``step``
releases it once every parameter has had the gradient of its chunk's last microbatch
(``prepare(True)``). A forward while autograd's engine is running is a recomputation.

Prefetch (``prefetch`` units deep): right before a unit computes, the gathers of
the next ``prefetch`` units are issued asynchronously, in forward order during
forward and in backward order during backward (both recorded in the first step;
until then the backward uses the reversed forward order), so unit i+1's all-gather
runs while unit i computes. Recomputation (activation checkpointing) runs a unit's
forward again inside its backward: it finds the unit gathered by its pre-backward
hook and changes nothing.

Gradients are stage 2's (``grad_sharded``, reduce-scattered into this rank's
gradient shard in every backward); this object observes them (``GradObserver``) to
release units, and ``grads_finalized`` releases whatever is still whole. Between
steps only shards exist: the optimizer updates ``shards`` in place and the next
forward gathers the new values (no all-gather after the step).

Every DP rank runs the same model and schedule and records the same orders, so all
ranks issue the same all-gathers in the same order.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from typing import Any, Iterator

import torch

from parallel3d import comm
from parallel3d.parallel_state import ParallelState
from parallel3d.zero.buffers import Bucket, BufferLayout, shard_slice
from parallel3d.zero.memory import MemoryTracker, nbytes
from parallel3d.zero.units import GatherUnit

def _recomputing() -> bool:
    """Whether autograd's engine is running on this thread (a forward now recomputes activations)."""
    return torch._C._current_graph_task_id() != -1


def _tensors_requiring_grad(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output] if output.requires_grad else []
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _tensors_requiring_grad(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in _tensors_requiring_grad(item)]
    return []


class ShardedParams:
    """Stage-3 parameters of ``units`` laid out by ``layouts`` (see module doc); ``reshard`` is resolved."""

    def __init__(self, layouts: list[BufferLayout], units: list[GatherUnit], pstate: ParallelState, *,
                 device: torch.device, memory: MemoryTracker, prefetch: int, reshard: str) -> None:
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"parallel.zero3_prefetch={prefetch!r} must be an integer >= 0")
        if reshard not in ("microbatch", "step"):
            raise ValueError(f"reshard={reshard!r} must be 'microbatch' or 'step' (resolve 'auto' first)")
        self.layouts, self.units, self.pstate = layouts, units, pstate
        self.memory, self.prefetch = memory, prefetch
        self.per_microbatch = reshard == "microbatch"
        self.shards: list[torch.Tensor] = []
        self.full: list[list[torch.Tensor]] = []  # [group][bucket index]: storage freed while released
        self._unit_of: dict[int, GatherUnit] = {id(p): u for u in units for p in u.params}
        for g, layout in enumerate(layouts):
            shard = torch.empty(layout.shard_numel, dtype=layout.dtype, device=device)
            memory.add("model_weights", nbytes(shard))
            self.shards.append(shard)
            self.full.append([self._adopt(g, b, shard, device) for b in layout.buckets])
        self._whole: set[tuple[int, int]] = set()
        self._works: dict[tuple[int, int], Any] = {}
        self._fwd_order: dict[int, list[int]] = {}
        self._bwd_order: dict[int, list[int]] = {}
        self._orders_final = False
        self._handles = []
        for u in units:
            self._handles.append(u.module.register_forward_pre_hook(partial(self._pre_forward, u)))
            self._handles.append(u.module.register_forward_hook(partial(self._post_forward, u)))

    @torch.no_grad()
    def _adopt(self, group: int, bucket: Bucket, shard: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Copy the bucket's parameters into a full tensor, keep this rank's piece, make the parameters
        views of the tensor and free its storage (the bucket starts released)."""
        full = torch.empty(bucket.size, dtype=shard.dtype, device=device)
        full[bucket.used :].zero_()
        units = set()
        for s in bucket.slots:
            view = full[s.start - bucket.start : s.end - bucket.start]
            view.copy_(s.param.detach().reshape(-1))
            s.param.data = view.view(s.param.shape)
            units.add(self._unit_of[id(s.param)].index)
        shard_slice(shard, bucket).copy_(full[bucket.piece_start - bucket.start :][: bucket.piece_size])
        if len(units) != 1:
            raise RuntimeError(f"bucket {bucket.index} spans gather units {sorted(units)} (layout not unit-aligned)")
        self.units[units.pop()].buckets.append((group, bucket.index))
        full.untyped_storage().resize_(0)
        return full

    # ---- what the optimizer uses ------------------------------------------------------
    def piece(self, group: int, bucket: Bucket) -> torch.Tensor:
        """This rank's piece of ``bucket`` in the model dtype: the shard the next gather reads."""
        return shard_slice(self.shards[group], bucket)

    def publish(self, *, asynchronous: bool = False) -> None:
        """After an update: nothing to send (the next forward gathers); stale whole buckets go."""
        self.release_all()

    def finish(self) -> None:
        """Stage 3 has no post-step gather to finish (units are gathered and waited at use)."""

    gathers_in_flight = 0

    def release_all(self) -> None:
        for u in self.units:
            self._release(u)
            u.in_backward, u.pending, u.grads, u.closed = False, 0, {}, set()

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Every parameter whole inside the block (read-only: writes are not kept), released after."""
        before = {u.index for u in self.units if u.gathered}
        for u in self.units:
            self._gather(u, wait=False)
        for u in self.units:
            self._wait_unit(u)
        try:
            yield
        finally:
            for u in self.units:
                if u.index not in before:
                    self._release(u)

    def storage_tensors(self) -> list[torch.Tensor]:
        return self.shards + [t for per_group in self.full for t in per_group]

    def whole_bytes(self) -> int:
        """Bytes of buckets whole (or arriving) now."""
        return sum(nbytes(self.full[g][i]) for g, i in self._whole)

    # ---- GradObserver ------------------------------------------------------------------
    def grad_consumed(self, param: torch.nn.Parameter, is_last_microbatch: bool) -> None:
        u = self._unit_of.get(id(param))
        if u is None:
            return
        u.grads[id(param)] = u.grads.get(id(param), 0) + 1
        if is_last_microbatch:
            u.closed.add(id(param))
        # ``grads`` holds only parameters with a gradient beyond the completed backwards, and a count
        # rises by one at a time: all of them present = one more backward complete (O(1) to test).
        done = len(u.grads) == len(u.params)
        if done:
            u.pending = max(0, u.pending - 1)
            u.grads = {k: n - 1 for k, n in u.grads.items() if n > 1}
            u.in_backward = bool(u.grads)
        if self.per_microbatch:
            if done and not u.grads:  # no backward half-done (a B still owing its W): nothing reads the unit
                self._release(u)
        elif len(u.closed) == len(u.params):  # every parameter's last gradient of the step is in
            self._release(u)
            u.closed.clear()

    def grads_finalized(self) -> None:
        self.release_all()
        self._orders_final = True

    # ---- hooks ---------------------------------------------------------------------------
    def _pre_forward(self, u: GatherUnit, module: torch.nn.Module, args: Any) -> None:
        if _recomputing():  # inside the unit's backward: its pre-backward hook gathered it
            self._gather(u, wait=True)
            return
        self._gather(u, wait=False)
        self._note(self._fwd_order, u)
        self._prefetch_after(u, forward=True)
        self._wait_unit(u)

    def _post_forward(self, u: GatherUnit, module: torch.nn.Module, args: Any, output: Any) -> None:
        if _recomputing():
            return
        tensors = _tensors_requiring_grad(output) if torch.is_grad_enabled() else []
        if tensors:
            u.pending += 1
            fired = [False]

            def before_backward(grad: torch.Tensor) -> None:
                if not fired[0]:
                    fired[0] = True
                    self._pre_backward(u)

            for t in tensors:
                t.register_hook(before_backward)
            if self.per_microbatch and not u.is_root and not u.grads:
                self._release(u)
        elif u.pending == 0:  # no backward will follow (evaluation): nothing keeps the unit whole
            self._release(u)

    def _pre_backward(self, u: GatherUnit) -> None:
        u.in_backward = True
        self._gather(u, wait=False)
        self._note(self._bwd_order, u)
        self._prefetch_after(u, forward=False)
        self._wait_unit(u)

    # ---- prefetch order --------------------------------------------------------------------
    def _note(self, orders: dict[int, list[int]], u: GatherUnit) -> None:
        if self._orders_final or not u.buckets:  # an empty root gathers nothing: not a prefetch slot
            return
        order = orders.setdefault(u.chunk, [])
        if u.index not in order:
            order.append(u.index)

    def _prefetch_after(self, u: GatherUnit, *, forward: bool) -> None:
        if not self.prefetch:
            return
        fwd = self._fwd_order.get(u.chunk, [])
        if forward:
            order = fwd
        else:
            order = self._bwd_order.get(u.chunk, []) if self._orders_final else []
            order = order or list(reversed(fwd))
        if u.index in order:
            pos = order.index(u.index)
        elif not u.buckets and order:  # an empty root starts its chunk's pass: prefetch the first units
            pos = -1
        else:
            return
        for index in order[pos + 1 : pos + 1 + self.prefetch]:
            self._gather(self.units[index], wait=False)

    # ---- gather / release ------------------------------------------------------------------
    @torch.no_grad()
    def _gather(self, u: GatherUnit, *, wait: bool) -> None:
        for key in u.buckets:
            if key in self._whole:
                continue
            g, i = key
            b = self.layouts[g].buckets[i]
            full = self.full[g][i]
            full.untyped_storage().resize_(b.size * full.element_size())
            self.memory.add("model_weights", nbytes(full))
            self._whole.add(key)
            self._works[key] = comm.all_gather_into_tensor(full, self.piece(g, b), self.pstate,
                                                           self.layouts[g].reduce_kind,
                                                           async_op=True)
        u.gathered = bool(u.buckets)
        if wait:
            self._wait_unit(u)

    def _wait_unit(self, u: GatherUnit) -> None:
        for key in u.buckets:
            work = self._works.pop(key, None)
            if work is not None:
                work.wait()

    def _release(self, u: GatherUnit) -> None:
        for key in u.buckets:
            if key not in self._whole:
                continue
            work = self._works.pop(key, None)
            if work is not None:  # a prefetch nobody used: the collective must land before the memory goes
                work.wait()
            full = self.full[key[0]][key[1]]
            self.memory.add("model_weights", -nbytes(full))
            full.untyped_storage().resize_(0)
            self._whole.discard(key)
        u.gathered = False

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
