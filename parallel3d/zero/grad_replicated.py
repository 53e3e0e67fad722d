"""ZeRO stages 0 and 1: a full-size gradient buffer on every rank, reduced once per step.

Every rank holds the gradient of every parameter in one flat buffer per dtype
group (``buffers`` layout), so gradient memory is Ψ elements of the gradient
dtype whatever the accumulation. Two ways gradients get there:

- zero-copy (gradient dtype == parameter dtype, e.g. fp32 training): each
  ``.grad`` is a view into the buffer and autograd accumulates in place.
- fp32 main grads (bf16/fp16 parameters, ``grad_reduce_dtype="fp32"``): a
  post-accumulate-grad hook adds each microbatch's half-precision ``.grad``
  into the fp32 buffer and drops it, so the sum over microbatches is fp32.

Either way each parameter's main grad (``main_grad(param)``) is a view of its
bucket in the buffer, as Megatron's main-grad buffer is. During the backward
that completes a parameter's accumulation (``prepare(True)``) the hook also
counts its bucket's ready gradients and starts the bucket's reduction as soon as
it is complete, on the buffer itself: an in-place all-reduce (stage 0) or an
in-place reduce-scatter whose output is this rank's piece of the bucket (stage
1: DDP's bytes, no temporary, no copy), overlapping with the backward of the
layers before it (buckets are in backward order), as DDP does. ``finalize``
launches the rest (e.g. buckets of unused parameters).
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
        self._reset_step()
        if self.zero_copy:
            self._attach_grad_views()

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
        grad = param.grad
        if grad is not self._view_of[id(param)]:  # the zero-copy common case skips the call
            self._absorb(group, bucket, index, param)
        if not self._is_last:
            return
        # The base class lets each parameter through once with is_last, so the count is exact.
        ready = self._ready[group]
        ready[bucket.index] += 1
        if ready[bucket.index] == len(bucket.slots):
            self._launch(group, bucket)

    def _launch_leftovers(self) -> None:
        for g, gb in enumerate(self.grad_bufs):
            for b in gb.layout.buckets:
                launched = (g, b.index) in self._launched
                for i, s in enumerate(b.slots):
                    grad = s.param.grad
                    view = self._view_of[id(s.param)]
                    if grad is None or grad is view or grad.data_ptr() == view.data_ptr():  # identity first: cheap
                        continue
                    if launched:
                        raise RuntimeError(f"ZeRO: {s.name}.grad was replaced after its bucket's reduction started")
                    self._absorb(g, b, i, s.param)  # a .grad set outside backward
                if not launched:
                    self._launch(g, b)

    def _reset_step(self) -> None:
        self._ready: list[list[int]] = [[0] * len(layout.buckets) for layout in self.layouts]  # [group][bucket]
        self._launched: set[tuple[int, int]] = set()

    @torch.no_grad()
    def _zero_grads(self) -> None:
        for gb in self.grad_bufs:
            gb.data.zero_()
        if self.zero_copy:
            self._attach_grad_views()
        else:
            for gb in self.grad_bufs:
                for s in gb.layout.slots:
                    s.param.grad = None

    # ---- internals ---------------------------------------------------------------------
    @torch.no_grad()
    def _absorb(self, group: int, bucket: Bucket, index: int, param: torch.nn.Parameter) -> None:
        """Bring ``param.grad`` into the buffer (a no-op when it already is the buffer view)."""
        view = self._views[(group, bucket.index, index)]
        grad = param.grad
        if grad is view or grad.data_ptr() == view.data_ptr():
            return
        self.memory.transient("gradients", nbytes(grad))
        if self.zero_copy:  # autograd (or the caller) replaced the view: its tensor holds the sum
            view.copy_(grad)
            param.grad = view
        else:  # main grads: accumulate the half-precision contribution in the buffer's dtype
            view.add_(grad)
            param.grad = None

    def _launch(self, group: int, bucket: Bucket) -> None:
        self._launched.add((group, bucket.index))
        gb = self.grad_bufs[group]
        full = gb.bucket_view(bucket)
        if self.stage == 0:
            self.reducer.all_reduce(full, gb.layout.reduce_kind)
        else:  # in place: this rank's piece of the bucket is the collective's output (no copy, no temporary)
            self.reducer.reduce_scatter(full, gb.piece_view(bucket), gb.layout.reduce_kind, accumulate=False,
                                        receive_pool=self.receive_pool)

    @torch.no_grad()
    def _attach_grad_views(self) -> None:
        """Make each ``.grad`` the buffer view again (someone may have set it to None or replaced it)."""
        for param, view in self._param_views:
            grad = param.grad
            if grad is view:  # the common case: autograd accumulated in place (same tensor object)
                continue
            if grad is None:
                view.zero_()
            elif grad.data_ptr() != view.data_ptr():
                view.copy_(grad)
            param.grad = view
