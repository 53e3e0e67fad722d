"""Data-parallel gradient reduction for ZeRO stages 0, 1 and 2.

Contract with the pipeline engine (or a plain training loop): call
``prepare(is_last_microbatch)`` before each backward and ``finish()`` after the
step's last backward; ``ZeroOptimizer.step`` then calls ``complete()`` (which
finishes if nobody did, handles tied embeddings and waits for every
collective). Gradients are reduced once per step with SUM over the ``dp``
group; the optimizer divides by ``dp`` (and the loss scale) afterwards.

- Stage 0 / 1: every parameter's ``.grad`` is a view into a flat gradient
  buffer (autograd accumulates into it in place). During the last microbatch's
  backward a post-accumulate-grad hook counts each bucket's ready gradients and
  starts its all-reduce (stage 0) or reduce-scatter (stage 1; each rank's piece
  of the buffer then holds the reduced gradient it owns) asynchronously as soon
  as the bucket is complete, overlapping with the rest of backward as DDP does;
  ``finish`` launches whatever is left (e.g. buckets of unused parameters).
- Stage 2: there is no full gradient buffer. During the last microbatch's
  backward a post-accumulate-grad hook copies each gradient into its bucket's
  staging buffer and drops ``.grad``; when a bucket is complete its
  reduce-scatter starts asynchronously into the rank's gradient shard, so it
  overlaps with the backward of earlier layers. Staging buffers are recycled
  once their collective completes: normally two bucket-sized buffers exist.
- opt-in, gloo only (``reduce_scatter="auto"``; the default is a true reduce-scatter
  so stage 1/2 send exactly DDP's bytes): a bucket's reduce-scatter is done as an
  in-place all-reduce of the full bucket, after which this rank keeps its piece.
  gloo's ring all-reduce is ~2-3x faster than its reduce-scatter at bucket sizes
  (2 ranks, 1 MiB: ~1.1 ms vs ~2-3 ms), although it moves twice the bytes; the
  byte counters record the all-reduce that is actually sent. Same sums, same
  result (the reduction order is the backend's either way). NCCL keeps the
  reduce-scatter (where it is the cheaper collective).
- Tied-embedding copies sit in their own buckets, outside the hooks:
  ``complete`` first sums their gradient over the ``embedding`` group (a
  cross-stage collective, so not in ``finish``), then reduces them.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import torch
import torch.distributed as dist

from parallel3d import comm
from parallel3d.parallel_state import ParallelState
from parallel3d.zero.buffers import Bucket, FlatBuffer, ParamSlot, shard_slice

MAX_STAGING_BUFFERS = 2
REDUCE_SCATTER_MODES = ("auto", "reduce_scatter", "all_reduce")


def _sync_tied(modules: list[torch.nn.Module], tied: list[torch.nn.Parameter], pstate: ParallelState) -> None:
    """Sum tied-embedding gradients over the embedding group (pipeline's helper when it exists)."""
    if not tied:
        return
    try:
        from parallel3d.pipeline.tied import sync_tied_embedding_grads
    except ImportError:
        sync_tied_embedding_grads = None
    if sync_tied_embedding_grads is not None:
        sync_tied_embedding_grads(modules, pstate)
        return
    for p in tied:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        comm.all_reduce(p.grad, pstate, "embedding")


class GradSync:
    """Reduces gradients of the parameters in ``params_bufs`` (one FlatBuffer per dtype)."""

    def __init__(
        self,
        modules: list[torch.nn.Module],
        params_bufs: list[FlatBuffer],
        pstate: ParallelState,
        zero_stage: int,
        reduce_scatter: str = "reduce_scatter",
    ) -> None:
        if reduce_scatter not in REDUCE_SCATTER_MODES:
            raise ValueError(f"reduce_scatter={reduce_scatter!r} is not one of {REDUCE_SCATTER_MODES}")
        self.modules = modules
        self.params_bufs = params_bufs
        self.pstate = pstate
        self.stage = zero_stage
        self._rs_as_all_reduce = reduce_scatter == "all_reduce" or (
            reduce_scatter == "auto" and comm.group_size(pstate, "dp") > 1
            and dist.get_backend(pstate.group("dp")) == "gloo"
        )
        self._dp_rank = comm.group_rank(pstate, "dp")
        self._is_last = True
        self._finished = False
        self._completed = False
        self._pending: deque[tuple[object, Callable[[], None]]] = deque()
        self.grad_bufs: list[FlatBuffer] = []
        self.grad_shards: list[torch.Tensor] = []
        self._staging_free: list[torch.Tensor] = []
        self._staging_all: list[torch.Tensor] = []
        self._hooks = []
        self._tied = [s.param for pb in params_bufs for s in pb.layout.slots if s.tied]
        self._where: dict[int, tuple[int, Bucket, ParamSlot]] = {}
        for g, pb in enumerate(params_bufs):
            if zero_stage in (0, 1):
                self.grad_bufs.append(FlatBuffer(pb.layout, pb.data.dtype, pb.data.device))
            else:
                self.grad_shards.append(torch.zeros(pb.layout.shard_numel, dtype=pb.data.dtype, device=pb.data.device))
            for b in pb.layout.buckets:
                for s in b.slots:
                    self._where[id(s.param)] = (g, b, s)
                    if not s.tied:
                        self._hooks.append(s.param.register_post_accumulate_grad_hook(self._on_grad_ready))
        if zero_stage in (0, 1):
            self._attach_grad_views()
            self._reset_stage01()
        else:
            self._reset_stage2()

    # ---- engine-facing API ---------------------------------------------------------
    def prepare(self, is_last_microbatch: bool) -> None:
        """Called before each backward; only the last microbatch's backward reduces (stage 2)."""
        self._is_last = bool(is_last_microbatch)

    def finish(self) -> None:
        """Start the reduction of every bucket not started yet, except tied-embedding ones.

        It only launches collectives on this rank's ``dp`` group (whose members run the
        same schedule), never on a group that spans pipeline stages: the engine calls
        it before its last sends, so a cross-stage collective here could deadlock.
        """
        if self._finished:
            return
        if self.stage == 2:
            for g, pb in enumerate(self.params_bufs):
                for b in pb.layout.buckets:
                    if not b.tied and not self._launched[(g, b.index)]:
                        self._launch_stage2(g, b, fill_missing=True)
        else:
            self._attach_grad_views()
            for gb in self.grad_bufs:
                for b in gb.layout.buckets:
                    if not b.tied and (id(gb), b.index) not in self._launched01:
                        self._launch_stage01(gb, b)
        self._finished = True

    def complete(self) -> None:
        """``finish``, then sum tied embeddings over the embedding group, reduce them, and wait for all.

        Called by ``ZeroOptimizer.step`` after the pipeline step has returned.
        """
        if self._completed:
            return
        self.finish()
        _sync_tied(self.modules, self._tied, self.pstate)
        if self.stage == 2:
            for g, pb in enumerate(self.params_bufs):
                for b in pb.layout.buckets:
                    if b.tied:
                        self._launch_stage2(g, b, fill_missing=True)
        else:
            for gb in self.grad_bufs:
                for b in gb.layout.buckets:
                    if b.tied:
                        self._launch_stage01(gb, b)
        self._drain()
        self._completed = True

    # ---- what the optimizer reads ------------------------------------------------------
    def grad_piece(self, group: int, bucket: Bucket) -> torch.Tensor:
        """The DP-summed gradient of the piece of ``bucket`` this rank owns (after ``complete``)."""
        if self.stage == 2:
            return shard_slice(self.grad_shards[group], bucket)
        return self.grad_bufs[group].piece_view(bucket)

    def reset(self) -> None:
        """Start a new step (the previous step's reduced gradients are consumed)."""
        self._finished = False
        self._completed = False
        self._is_last = True
        if self.stage == 2:
            self._reset_stage2()
        else:
            self._reset_stage01()

    def zero_grad(self) -> None:
        self.reset()
        if self.stage == 2:
            for pb in self.params_bufs:
                for s in pb.layout.slots:
                    s.param.grad = None
        else:
            for gb in self.grad_bufs:
                gb.data.zero_()
            self._attach_grad_views()

    def staging_buffers(self) -> list[torch.Tensor]:
        return list(self._staging_all)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # ---- stages 0 and 1 --------------------------------------------------------------
    def _attach_grad_views(self) -> None:
        """Make each ``.grad`` the buffer view again (someone may have set it to None or replaced it)."""
        with torch.no_grad():
            for gb in self.grad_bufs:
                for s in gb.layout.slots:
                    view = gb.view_of(s)
                    g = s.param.grad
                    if g is None or g.data_ptr() != view.data_ptr():
                        if g is None:
                            view.zero_()
                        else:
                            view.copy_(g)
                        s.param.grad = view

    def _reset_stage01(self) -> None:
        self._ready01: dict[tuple[int, int], int] = {}
        self._launched01: set[tuple[int, int]] = set()

    def _on_grad_ready01(self, param: torch.nn.Parameter) -> None:
        """In the last microbatch's backward, reduce a bucket as soon as all its gradients are in.

        This is what overlaps the DP reduction of bucket k with the backward of the
        layers before it (buckets are laid out in backward order).
        """
        if not self._is_last or self._finished:
            return
        g, b, s = self._where[id(param)]
        gb = self.grad_bufs[g]
        key = (id(gb), b.index)
        if key in self._launched01:
            raise RuntimeError(
                f"ZeRO stage {self.stage}: gradient of {s.name} arrived after its bucket's reduction started; "
                f"with gradient accumulation call grad_sync.prepare(is_last_microbatch=False) before all but "
                f"the last backward"
            )
        view = gb.view_of(s)
        if param.grad is not view and param.grad.data_ptr() != view.data_ptr():
            with torch.no_grad():  # autograd replaced the buffer view: put the sum back into it
                view.copy_(param.grad)
            param.grad = view
        self._ready01[key] = self._ready01.get(key, 0) + 1
        if self._ready01[key] == len(b.slots):
            self._launch_stage01(gb, b)

    def _launch_stage01(self, gb: FlatBuffer, b: Bucket) -> None:
        self._launched01.add((id(gb), b.index))
        full = gb.bucket_view(b)
        if self.stage == 0:
            work = comm.all_reduce(full, self.pstate, "dp", async_op=True)
            self._pending.append((work, lambda: None))
            return
        if self._rs_as_all_reduce:  # the piece this rank owns lies inside `full`: nothing to copy
            work = comm.all_reduce(full, self.pstate, "dp", async_op=True)
            self._pending.append((work, lambda: None))
            return
        # gloo's reduce-scatter must not write into its own input: land in a temporary, then copy.
        out = torch.empty(b.piece_size, dtype=full.dtype, device=full.device)
        work = comm.reduce_scatter_tensor(out, full, self.pstate, "dp", async_op=True)
        piece = gb.piece_view(b)
        self._pending.append((work, lambda: piece.copy_(out)))

    # ---- stage 2 ---------------------------------------------------------------------
    def _reset_stage2(self) -> None:
        self._filled: set[int] = set()
        self._count: dict[tuple[int, int], int] = {}
        self._staging: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (bucket view, base)
        self._launched = {(g, b.index): False for g, pb in enumerate(self.params_bufs) for b in pb.layout.buckets}

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        if self.stage != 2:
            self._on_grad_ready01(param)
            return
        if not self._is_last:
            return
        g, b, s = self._where[id(param)]
        if id(param) in self._filled:
            raise RuntimeError(
                f"ZeRO stage 2: gradient of {s.name} arrived twice in one step; with gradient accumulation "
                f"call grad_sync.prepare(is_last_microbatch=False) before all but the last backward"
            )
        stage = self._staging_for(g, b)
        with torch.no_grad():
            stage[s.start - b.start : s.end - b.start].copy_(param.grad.reshape(-1))
        param.grad = None  # the full gradient does not outlive its bucket
        self._filled.add(id(param))
        key = (g, b.index)
        self._count[key] = self._count.get(key, 0) + 1
        if self._count[key] == len(b.slots):
            self._launch_stage2(g, b, fill_missing=False)

    def _staging_for(self, g: int, b: Bucket) -> torch.Tensor:
        key = (g, b.index)
        if key not in self._staging:
            self._reap(block=False)
            # Double buffering: fill one bucket while the previous one is reduced; beyond two
            # buffers, wait for the oldest collective rather than allocate (unless none is in flight).
            if not self._staging_free and self._pending and len(self._staging_all) >= MAX_STAGING_BUFFERS:
                self._reap(block=True)
            dtype = self.params_bufs[g].data.dtype
            free = [t for t in self._staging_free if t.dtype == dtype]
            if free:
                buf = free[0]
                self._staging_free.remove(buf)
            else:
                buf = torch.empty(self.params_bufs[g].layout.max_bucket_size, dtype=dtype,
                                  device=self.params_bufs[g].data.device)
                self._staging_all.append(buf)
            view = buf[: b.size]
            view[b.used :].zero_()  # padding
            self._staging[key] = (view, buf)
        return self._staging[key][0]

    def _launch_stage2(self, g: int, b: Bucket, fill_missing: bool) -> None:
        stage = self._staging_for(g, b)
        if fill_missing:
            with torch.no_grad():
                for s in b.slots:
                    if id(s.param) in self._filled:
                        continue
                    dst = stage[s.start - b.start : s.end - b.start]
                    if s.param.grad is None:
                        dst.zero_()  # an unused parameter contributes nothing
                    else:
                        dst.copy_(s.param.grad.reshape(-1))
                        s.param.grad = None
                    self._filled.add(id(s.param))
        self._launched[(g, b.index)] = True
        out = shard_slice(self.grad_shards[g], b)
        _, base = self._staging.pop((g, b.index))
        if self._rs_as_all_reduce:
            work = comm.all_reduce(stage, self.pstate, "dp", async_op=True)
            mine = stage[self._dp_rank * b.piece_size : (self._dp_rank + 1) * b.piece_size]

            def done() -> None:
                out.copy_(mine)
                self._staging_free.append(base)

            self._pending.append((work, done))
            return
        work = comm.reduce_scatter_tensor(out, stage, self.pstate, "dp", async_op=True)
        self._pending.append((work, lambda: self._staging_free.append(base)))

    # ---- completion ------------------------------------------------------------------
    def _reap(self, block: bool) -> None:
        """Complete finished collectives (or the oldest one, if ``block``)."""
        while self._pending:
            work, done = self._pending[0]
            if work is not None and not block and not work.is_completed():
                return
            if work is not None:
                work.wait()
            done()
            self._pending.popleft()
            if block:
                return

    def _drain(self) -> None:
        while self._pending:
            self._reap(block=True)
