"""ZeRO stages 0 and 1: a full-size gradient buffer on every rank, reduced once per step.

Every rank holds the gradient of every parameter in one flat buffer per dtype
group (``buffers`` layout), so gradient memory is Ψ elements of the gradient
dtype whatever the accumulation. Each parameter's main grad (``main_grad(param)``)
is a view of its bucket in the buffer, as Megatron's main-grad buffer is.

``zero_grad`` writes nothing into the buffer: it sets every ``.grad`` to None (torch's
``set_to_none``, as DDP runs) and the first gradient of each parameter after it *writes*
its view instead of adding to a zeroed one, so a step makes one pass over the buffer
where zeroing, adding and the bucket's ``1/n`` scale made three:

- zero-copy (gradient dtype == parameter dtype, e.g. fp32 training): autograd hands
  the fresh gradient over as ``.grad`` (no ``.grad`` to add to); the
  post-accumulate-grad hook copies it into the view and binds ``.grad`` to the view,
  so later microbatches' gradients accumulate there in place (autograd's ``+=``). On
  the backward that completes the parameter's accumulation (``prepare(True)``) that
  copy is the reducer's ``scale_into`` (the ``1/n`` multiplication of the bucket pass,
  the same value bitwise: ``0 + g == g``), and a bucket whose slots were all written
  so skips the pass. Whatever tensor ``.grad`` is when the hook runs holds the
  parameter's sum so far (the fresh gradient, or a ``.grad`` the caller set, into which
  autograd added), so the copy is exact in both cases.
- fp32 main grads (bf16/fp16 parameters, ``grad_reduce_dtype="fp32"``): the hook
  copies (casts) the parameter's first half-precision ``.grad`` after ``zero_grad`` into
  the fp32 buffer and adds the later ones there, and drops ``.grad``; the sum over
  microbatches is fp32; the bucket pass scales it.

A parameter that got no gradient since ``zero_grad`` (unused this step; ``.grad`` None)
has its view zeroed and bound by ``finalize``: after ``finalize`` every ``.grad``
(zero-copy) is its view, holding the reduced gradient. Without ``zero_grad`` between
steps, bound views keep accumulating (torch's semantics, and the old design's).

During the backward that completes a parameter's accumulation the hook also counts
its bucket's ready gradients and starts the bucket's reduction as soon as it is
complete, on the buffer itself: an in-place all-reduce (stage 0) or an in-place
reduce-scatter whose output is this rank's piece of the bucket (stage 1: DDP's bytes,
no temporary, no copy), overlapping with the backward of the layers before it
(buckets are in backward order), as DDP does. ``finalize`` launches the rest (e.g.
buckets of unused parameters).
"""

from __future__ import annotations

import torch

from parallel3d.parallel_state import ParallelState
from parallel3d.zero.buffers import Bucket, BufferLayout, FlatBuffer
from parallel3d.zero.grad_sync import GradSync
from parallel3d.zero.memory import MemoryTracker, nbytes
from parallel3d.zero.staging import GLOO_BUCKET_BUFFERS, StagingPool


class ReplicatedGradSync(GradSync):
    """Stages 0/1. ``grad_bufs[g]`` has ``layouts[g]``'s layout in the gradient dtype; after
    ``finalize`` the pieces this rank owns (stage 0: everything) hold the DP-mean gradient."""

    def __init__(self, modules: list[torch.nn.Module], layouts: list[BufferLayout], pstate: ParallelState, *,
                 zero_stage: int, device: torch.device, grad_dtype: torch.dtype, reduce_scatter: str,
                 memory: MemoryTracker) -> None:
        if zero_stage not in (0, 1):
            raise ValueError(f"ReplicatedGradSync serves ZeRO stages 0 and 1, not {zero_stage}")
        super().__init__(modules, layouts, pstate, device=device, grad_dtype=grad_dtype,
                         reduce_scatter=reduce_scatter, memory=memory)
        self.stage = zero_stage
        self.grad_bufs = [FlatBuffer(layout, grad_dtype, device) for layout in layouts]
        for gb in self.grad_bufs:
            memory.add("gradients", nbytes(gb.data))
        self.zero_copy = all(layout.dtype == grad_dtype for layout in layouts)
        # Stage 1 on gloo: the reduce-scatter exchanges' receive buffers (``reduction``).
        self.receive_pool = (StagingPool(max(layout.max_bucket_size for layout in layouts), grad_dtype, device, memory,
                                         limit=GLOO_BUCKET_BUFFERS)
                             if zero_stage == 1 and self.exchanges else None)
        # Each slot's view of the gradient buffer, by (group, bucket index, slot index).
        self._views = {(g, b.index, i): gb.view_of(s) for g, gb in enumerate(self.grad_bufs)
                       for b in gb.layout.buckets for i, s in enumerate(b.slots)}
        # (param, its view) in buffer order: ``zero_grad`` walks this list, no per-step lookups.
        self._param_views = [(s.param, self._views[(g, b.index, i)]) for g, gb in enumerate(self.grad_bufs)
                             for b in gb.layout.buckets for i, s in enumerate(b.slots)]
        self._view_of = {id(param): view for param, view in self._param_views}  # the hook's one lookup
        # Main grads: the params whose next gradient writes (not adds to) its view (every one after zero_grad;
        # the buffer starts zeroed, so writing and adding agree for the first step).
        self._fresh: set[int] = set(self._view_of)
        self._bucket_count = sum(len(layout.buckets) for layout in layouts)
        self._reset_step()

    def grad_piece(self, group: int, bucket: Bucket) -> torch.Tensor:
        return self.grad_bufs[group].piece_view(bucket)

    def main_grad(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        g, b, i = self._where[id(param)]
        return self._views[(g, b.index, i)]

    def gradient_tensors(self) -> list[torch.Tensor]:
        return [gb.data for gb in self.grad_bufs]

    def staging_buffers(self) -> list[torch.Tensor]:
        return [] if self.receive_pool is None else list(self.receive_pool.buffers)

    # ---- strategy hooks ----------------------------------------------------------------
    def _on_grad_ready(self, group: int, bucket: Bucket, index: int, param: torch.nn.Parameter) -> None:
        key = id(param)
        view = self._view_of[key]
        if param.grad is not view:  # zero-copy: bound after the first write, so later microbatches skip this
            self._write(group, bucket, key, param, view)
        if not self._is_last:
            return
        # The base class lets each parameter through once with is_last, so the count is exact.
        ready = self._ready[group]
        ready[bucket.index] += 1
        if ready[bucket.index] == len(bucket.slots):
            self._launch(group, bucket)

    def _write(self, group: int, bucket: Bucket, key: int, param: torch.nn.Parameter, view: torch.Tensor) -> None:
        """Bring ``param.grad`` (this parameter's sum since ``zero_grad``, or a main grad's new
        half-precision contribution) into ``view`` (module doc)."""
        grad = param.grad
        if not self.zero_copy:  # main grads: cast into the fp32 buffer; the first one after zero_grad writes
            self.memory.transient("gradients", nbytes(grad))
            self._add_main_grad(key, param, view)
            return
        # No transient counted: the gradient autograd hands over is the one it produced in the old
        # design too (before adding it in place), the planner's zero-copy term. A ``.grad`` that is the
        # view's memory under another tensor object is copied (or scaled) onto itself: the same values.
        if self._is_last:  # nothing more will arrive: the copy is also the bucket's 1/n pass
            self.reducer.scale_into(view, grad)
            self._mark_scaled(group, bucket, key)
        else:
            view.copy_(grad)
        param.grad = view

    def _add_main_grad(self, key: int, param: torch.nn.Parameter, view: torch.Tensor) -> None:
        """Main grads: add ``param.grad`` (one half-precision contribution) into its fp32 ``view`` and drop it;
        the first contribution since ``zero_grad`` writes instead (the view was not zeroed)."""
        if key in self._fresh:
            self._fresh.discard(key)
            view.copy_(param.grad)
        else:
            view.add_(param.grad)
        param.grad = None

    def _mark_scaled(self, group: int, bucket: Bucket, key: int) -> None:
        self._scaled.add(key)
        self._scaled_count[group][bucket.index] += 1

    def _launch_leftovers(self) -> None:
        if (self.zero_copy and len(self._launched) == self._bucket_count
                and all(p.grad is v for p, v in self._param_views)):
            return  # the common step: every bucket launched from the hooks, every .grad still its view
        for g, gb in enumerate(self.grad_bufs):
            for b in gb.layout.buckets:
                launched = (g, b.index) in self._launched
                for i, s in enumerate(b.slots):
                    key = id(s.param)
                    grad = s.param.grad
                    view = self._view_of[key]
                    if grad is view:  # identity first: cheap
                        continue
                    if grad is None:  # zero-copy: no gradient since zero_grad; main grads: unless not fresh
                        if not launched and (self.zero_copy or key in self._fresh):
                            self._zero_unused(g, b, key, view, s.param)
                        continue
                    if grad.data_ptr() == view.data_ptr():
                        continue
                    if launched:
                        raise RuntimeError(f"ZeRO: {s.name}.grad was replaced after its bucket's reduction started")
                    self._absorb_late(g, b, key, s.param, view)  # a .grad set outside backward
                if not launched:
                    self._launch(g, b)

    def _zero_unused(self, group: int, bucket: Bucket, key: int, view: torch.Tensor,
                     param: torch.nn.Parameter) -> None:
        """No gradient since ``zero_grad``: its view holds an older step's values, so it is zeroed
        (zero needs no ``1/n``) and, zero-copy, bound as ``.grad`` as every other parameter's view."""
        view.zero_()
        self._fresh.discard(key)
        if self.zero_copy:
            param.grad = view
        self._mark_scaled(group, bucket, key)

    @torch.no_grad()
    def _absorb_late(self, group: int, bucket: Bucket, key: int, param: torch.nn.Parameter,
                     view: torch.Tensor) -> None:
        """A ``.grad`` set after backward, before its bucket launched: its value is the sum (unscaled)."""
        grad = param.grad
        self.memory.transient("gradients", nbytes(grad))
        if key in self._scaled:
            self._scaled.discard(key)
            self._scaled_count[group][bucket.index] -= 1
        if self.zero_copy:
            view.copy_(grad)
            param.grad = view
        else:  # main grads: a contribution on top of the buffer's sum
            self._add_main_grad(key, param, view)

    def _reset_step(self) -> None:
        self._ready: list[list[int]] = [[0] * len(layout.buckets) for layout in self.layouts]  # [group][bucket]
        self._launched: set[tuple[int, int]] = set()
        # Slots already multiplied by 1/n this step (written scaled, or zeroed), and their count per bucket.
        self._scaled: set[int] = set()
        self._scaled_count: list[list[int]] = [[0] * len(layout.buckets) for layout in self.layouts]

    def _zero_grads(self) -> None:
        for param, _view in self._param_views:
            param.grad = None
        self._fresh = set(self._view_of)

    # ---- internals ---------------------------------------------------------------------
    def _launch(self, group: int, bucket: Bucket) -> None:
        self._launched.add((group, bucket.index))
        gb = self.grad_bufs[group]
        full = gb.bucket_view(bucket)
        done = self._scaled_count[group][bucket.index]
        scaled = done == len(bucket.slots)  # the padding is zero: it needs no scaling either
        if done and not scaled:  # some slots written scaled, some accumulated: scale the others alone
            for i, s in enumerate(bucket.slots):
                if id(s.param) not in self._scaled:
                    self.reducer.scale_(self._views[(group, bucket.index, i)])
            scaled = True
        if self.stage == 0:
            self.reducer.all_reduce(full, gb.layout.reduce_kind, scaled=scaled)
        else:  # in place: this rank's piece of the bucket is the collective's output (no copy, no temporary)
            self.reducer.reduce_scatter(full, gb.piece_view(bucket), gb.layout.reduce_kind, accumulate=False,
                                        receive_pool=self.receive_pool, scaled=scaled)
