"""The gradient-synchronisation interface shared by the ZeRO strategies, and the one
owner of gradient finalisation.

Contract with the pipeline engine (or a plain training loop): call
``prepare(is_last_microbatch)`` before each backward (True on the backward that
completes a model chunk's accumulation: once per chunk with interleaved
schedules; a plain loop without accumulation may skip it, True is the default)
and ``finalize()`` once after the step's last backward and the last pipeline
send. ``finalize`` is the single place where a step's gradients become final,
in the order Megatron's ``finalize_model_grads`` uses: launch the reductions
not started yet (each over its layout's ``reduce_kind`` group), wait for every collective, sum tied-embedding
pieces over the ``embedding`` group, then tell observers (stage 3 frees the
parameters still gathered). It is idempotent per step, so
``ZeroOptimizer.step`` calls it too (for loops that did not) and then reads
``grad_piece`` and calls ``reset``.

Scaling, end to end (nobody else scales gradients): the engine multiplies each
microbatch's loss by ``loss_scale / num_microbatches`` (the loss side: backward
must see the scaled loss); ``reduction.BucketReducer`` multiplies each bucket by
``1/n`` (n = the size of its replica group) right before its collective (or, stages
0/1, the first write of each gradient into its bucket does, with the reducer's
``scale_into``, when nothing more will be added to it: ``grad_replicated``);
``ZeroOptimizer.step`` multiplies by ``1/loss_scale`` (folded into the clipping
coefficient). So after ``finalize``, ``grad_piece(g, b)`` is the replica mean of
this rank's piece of bucket ``b`` times the loss scale.

Invariants every strategy keeps:
- Gradients live in the gradient dtype: fp32 ("main grads", the default with
  bf16/fp16 parameters: every microbatch's half-precision ``.grad`` is added
  into fp32 by a post-accumulate-grad hook and dropped) or the parameter dtype
  (``grad_reduce_dtype`` equal to the precision: half the bytes; this is the
  zero-copy path where ``.grad`` is a view of its bucket and autograd adds in place;
  stages 0/1 bind it at the step's first gradient, stage 2 at the bucket's staging).
- Every parameter's main grad (``main_grad``) is a view of its bucket's contiguous
  buffer, and every reduction runs on that buffer: a gradient reaches it in one pass (autograd's
  in-place add, or stages 0/1's first write of a step) and is not copied again on its way to
  the collective, and a reduce-scatter's output is the shard or the buffer's own piece.
- Collectives are launched from gradient hooks in the order gradients arrive
  (backward order; a split backward's W arrives in its own queue order) and by
  ``finalize`` in bucket order; every DP rank runs the same model and schedule,
  so it produces the same gradients in the same order (as DDP assumes) and the
  collectives match.
- A gradient that arrives after its parameter's last microbatch (a backward
  without ``prepare(False)`` before it) or after ``finalize`` raises instead of
  being lost.

Strategies: ``ReplicatedGradSync`` (stages 0/1, ``grad_replicated``) and
``ShardedGradSync`` (stages 2/3, ``grad_sharded``), sharing ``buffers``' layout.

Tied embeddings (pp > 1): the first and last stage each hold a copy in buckets
of their own; both strategies reduce them over their replica group like any other bucket, and
``finalize`` then all-reduces just this rank's reduced piece over the
``embedding`` group (the sum is linear, so the order does not matter); a rank
holding both copies (ZB-V's stage 0) adds its two pieces instead, and takes part in
the group's exchange with nothing to sum. Both
ends have the same tp/dp coordinates and the same tied parameters, hence the
same tied bucket sizes and pieces; ``finalize`` checks that once. (Without ZeRO
the engine's finaliser is ``pipeline.tied.TiedGradFinalizer``.)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

import torch
import torch.distributed as dist

from parallel3d import comm, param_meta
from parallel3d.parallel_state import ParallelState
from parallel3d.zero.buffers import Bucket, BufferLayout
from parallel3d.zero.memory import MemoryTracker
from parallel3d.zero.reduction import BucketReducer, PendingCollectives
from parallel3d.zero.staging import MAX_STAGING_BUFFERS

__all__ = ["GradObserver", "GradSync", "MAX_STAGING_BUFFERS", "REDUCE_SCATTER_MODES"]

# "reduce_scatter" (default): a true reduce-scatter, so stages 1-2 send exactly DDP's bytes (on gloo
# an exchange, ``reduction``: gloo's own reduce_scatter_tensor all-reduces a clone of the bucket).
# "auto" (opt-in, gloo only): an in-place all-reduce of the whole bucket, after which this rank
# keeps its piece: twice the bytes (counted as sent), no receive buffer. NCCL keeps the
# reduce-scatter. "all_reduce" forces the all-reduce on any backend.
REDUCE_SCATTER_MODES = ("auto", "reduce_scatter", "all_reduce")


class GradObserver(Protocol):
    """Told about gradients as they are consumed (stage 3 frees gathered parameters with it)."""

    def grad_consumed(self, param: torch.nn.Parameter, is_last_microbatch: bool) -> None: ...

    def grads_finalized(self) -> None: ...


class GradSync(ABC):
    """Reduces the gradients of the parameters in ``layouts`` over each layout's ``reduce_kind`` group.

    ``device``: where gradient buffers live. ``grad_dtype``: dtype gradients are accumulated
    and reduced in. ``memory`` receives this object's allocations (``gradients``,
    ``buckets``) and transient ``.grad`` bytes.
    """

    def __init__(self, modules: list[torch.nn.Module], layouts: list[BufferLayout], pstate: ParallelState, *,
                 device: torch.device, grad_dtype: torch.dtype, reduce_scatter: str, memory: MemoryTracker) -> None:
        if reduce_scatter not in REDUCE_SCATTER_MODES:
            raise ValueError(f"reduce_scatter={reduce_scatter!r} is not one of {REDUCE_SCATTER_MODES}")
        self.modules = modules
        self.layouts = layouts
        self.device = device
        self.pstate = pstate
        self.grad_dtype = grad_dtype
        self.memory = memory
        # Every group of a ParallelState has its backend, so gloo's fast path is the job's choice.
        as_all_reduce = reduce_scatter == "all_reduce" or (reduce_scatter == "auto" and pstate.backend == "gloo")
        self.pending = PendingCollectives()
        self.reducer = BucketReducer(pstate, as_all_reduce=as_all_reduce, pending=self.pending)
        # gloo reduce-scatters by exchange into a recycled receive buffer (``reduction``), which the
        # strategy passes with each reduce-scatter: its own pool (stage 1) or the staging pool (2/3).
        self.exchanges = pstate.backend == "gloo" and not as_all_reduce
        self._where: dict[int, tuple[int, Bucket, int]] = {}  # id(param) -> (group, bucket, slot index)
        self._tied: list[tuple[int, Bucket]] = []
        self._tied_checked = False
        self._hooks = []
        for g, layout in enumerate(layouts):
            for b in layout.buckets:
                if b.tied:
                    self._tied.append((g, b))
                for i, s in enumerate(b.slots):
                    self._where[id(s.param)] = (g, b, i)
                    self._hooks.append(s.param.register_post_accumulate_grad_hook(self._hook))
        # Both copies on this rank (ZB-V: the first and last model chunk on stage 0): (embedding's, head's).
        heads = [(g, b) for g, b in self._tied if param_meta.is_tied_head_copy(b.slots[0].param)]
        embeddings = [(g, b) for g, b in self._tied if not param_meta.is_tied_head_copy(b.slots[0].param)]
        self._local_pairs = list(zip(embeddings, heads)) if heads and embeddings else []
        if self._local_pairs:
            self._tied = []
        self._is_last = True
        self._finalized = False
        # Whether finalize sums tied pieces (and checks them over ``embedding``): False for a part of
        # ``mixed.MixedGradSync`` without the dense layout, so every rank joins that exchange once.
        self.sums_tied = True
        self._closed: set[int] = set()  # params whose last microbatch's gradient has arrived this step
        self._observers: list[GradObserver] = []

    # ---- engine-facing API ---------------------------------------------------------
    def prepare(self, is_last_microbatch: bool) -> None:
        """Before each backward: whether it completes its chunk's gradient accumulation."""
        self._is_last = bool(is_last_microbatch)

    def finalize(self) -> None:
        """Make this step's gradients final (module doc); every rank of the job calls it once per
        step after its last backward and pipeline send. Idempotent until ``reset``."""
        if self._finalized:
            return
        self._finalized = True  # from here on a late gradient raises
        self._launch_leftovers()
        self.pending.drain()
        self._sum_tied()
        for obs in self._observers:
            obs.grads_finalized()

    @property
    def finalized(self) -> bool:
        return self._finalized

    def add_observer(self, observer: GradObserver) -> None:
        """``observer`` hears of every consumed gradient (after this object's own hook) and of ``finalize``."""
        self._observers.append(observer)

    def reset(self) -> None:
        """Start a new step (the previous step's reduced gradients have been consumed)."""
        self.pending.drain()  # nothing may still write into buffers the next step reuses
        self._is_last = True
        self._finalized = False
        self._closed = set()
        self._reset_step()

    def zero_grad(self) -> None:
        self.reset()
        self._zero_grads()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # ---- what the optimizer reads ------------------------------------------------------
    @abstractmethod
    def grad_piece(self, group: int, bucket: Bucket) -> torch.Tensor:
        """The DP-mean gradient of the piece of ``bucket`` this rank owns (valid after ``finalize``)."""

    @abstractmethod
    def gradient_tensors(self) -> list[torch.Tensor]:
        """The persistent gradient storage (buffers or shards), for ``memory_bytes``."""

    def staging_buffers(self) -> list[torch.Tensor]:
        return []

    def holds(self, param: torch.nn.Parameter) -> bool:
        """Whether ``param`` lies in one of this strategy's layouts."""
        return id(param) in self._where

    @abstractmethod
    def main_grad(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """``param``'s gradient in the gradient dtype, as a view of its bucket's buffer (None: its
        bucket holds no buffer now, stage 2/3 between reductions). With the gradient dtype equal to
        the parameter's, ``param.grad`` is this view while it is bound (autograd adds in place)."""

    # ---- strategy hooks ----------------------------------------------------------------
    @abstractmethod
    def _on_grad_ready(self, group: int, bucket: Bucket, index: int, param: torch.nn.Parameter) -> None:
        """``param.grad`` holds a new contribution (slot ``bucket.slots[index]``); runs with grad mode off."""

    @abstractmethod
    def _launch_leftovers(self) -> None:
        """Called once by ``finalize``: launch every reduction not started yet, in bucket order."""

    @abstractmethod
    def _reset_step(self) -> None: ...

    @abstractmethod
    def _zero_grads(self) -> None: ...

    # ---- shared machinery -------------------------------------------------------------
    def _hook(self, param: torch.nn.Parameter) -> None:
        # Runs once per parameter per backward in Python (DDP's reducer is C++): no allocation, no
        # context manager, one dict lookup on the common path (the callers' grad mode is off in backward).
        key = id(param)
        g, b, i = self._where[key]
        if self._finalized or key in self._closed:
            when = "finalize()" if self._finalized else "its last microbatch's backward"
            raise RuntimeError(
                f"ZeRO: gradient of {b.slots[i].name} arrived after {when} in this step (its bucket may "
                f"already be reducing); with gradient accumulation call "
                f"grad_sync.prepare(is_last_microbatch=False) before all but the last backward"
            )
        if self._is_last:
            self._closed.add(key)
        if torch.is_grad_enabled():  # backward(create_graph=True): nothing here may join the graph
            with torch.no_grad():
                self._on_grad_ready(g, b, i, param)
        else:
            self._on_grad_ready(g, b, i, param)
        if self._observers:
            for obs in self._observers:
                obs.grad_consumed(param, self._is_last)

    def _sum_tied(self) -> None:
        """Sum the reduced tied-embedding pieces: on this rank where it holds both copies, else
        over the ``embedding`` group (first + last stage)."""
        if not self.sums_tied:
            return
        for (ga, a), (gb, b) in self._local_pairs:
            mine, other = self.grad_piece(ga, a), self.grad_piece(gb, b)
            if mine.shape != other.shape or a.piece_start - a.start != b.piece_start - b.start:
                raise RuntimeError(f"rank {self.pstate.rank}: the two tied-embedding copies' buckets differ")
            mine.add_(other)
            other.copy_(mine)
        if not self.pstate.in_embedding_group or comm.group_size(self.pstate, "embedding") == 1:
            return
        if not self._tied_checked:  # also when this end has no tied buckets: the other end must not either
            self._check_tied_layout()
            self._tied_checked = True
        works = [comm.all_reduce(self.grad_piece(g, b), self.pstate, "embedding", async_op=True) for g, b in self._tied]
        for w in works:
            if w is not None:
                w.wait()

    def _check_tied_layout(self) -> None:
        """Both ends must hold identical tied buckets and pieces, or the element-wise sum is wrong."""
        sig = [len(self._tied), 0, 0, 0, 0]
        for k, (_, b) in enumerate(self._tied, start=1):
            sig[1] += len(b.slots)
            sig[2] += k * b.used
            sig[3] += k * b.size
            sig[4] += k * (b.piece_start - b.start)
        hi = torch.tensor(sig, dtype=torch.int64, device=self.device)
        lo = hi.clone()
        comm.all_reduce(hi, self.pstate, "embedding", op=dist.ReduceOp.MAX)
        comm.all_reduce(lo, self.pstate, "embedding", op=dist.ReduceOp.MIN)
        if not torch.equal(hi, lo):
            raise RuntimeError(
                f"rank {self.pstate.rank}: the tied-embedding buckets differ between the first and last "
                f"pipeline stage (signature min {lo.tolist()} vs max {hi.tolist()}); both ends must hold the "
                f"same tied parameters"
            )
