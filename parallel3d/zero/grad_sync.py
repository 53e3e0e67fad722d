"""The gradient-synchronisation interface shared by the ZeRO strategies.

Contract with the pipeline engine (or a plain training loop): call
``prepare(is_last_microbatch)`` before each backward (True on the backward that
completes a model chunk's accumulation: once per chunk with interleaved
schedules; a plain loop without accumulation may skip it, True is the default)
and ``finish()`` after the step's last backward. ``ZeroOptimizer.step`` then
calls ``complete()`` (which finishes if nobody did, waits for every collective
and sums tied embeddings), reads ``grad_piece`` and calls ``reset``.

Invariants every strategy keeps:
- After ``complete``, ``grad_piece(g, b)`` is the *DP mean* of this rank's
  piece of bucket ``b`` (times the loss scale): ``reduction.BucketReducer``
  divides by dp right before each collective; nobody else does.
- Gradients live in the gradient dtype: fp32 ("main grads", the default with
  bf16/fp16 parameters: every microbatch's half-precision ``.grad`` is added
  into fp32 by a post-accumulate-grad hook and dropped) or the parameter dtype
  (``grad_reduce_dtype`` equal to the precision: half the bytes; with fp32
  training this is the zero-copy path where ``.grad`` is a buffer view).
- Collectives are launched from gradient hooks in backward order and by
  ``finish`` in bucket order; every DP rank runs the same model and schedule,
  so it produces the same gradients in the same order (as DDP assumes) and the
  collectives match. ``finish`` uses only the ``dp`` group; the one cross-stage
  collective (the tied-embedding sum over ``embedding``) runs in ``complete``,
  because the engine calls ``finish`` before its last pipeline sends.
- A gradient that arrives after its parameter's last microbatch (a backward
  without ``prepare(False)`` before it) raises instead of being lost.

Strategies: ``ReplicatedGradSync`` (stages 0/1, ``grad_replicated``) and
``ShardedGradSync`` (stage 2, ``grad_sharded``), sharing ``buffers``' layout.

Tied embeddings (pp > 1): the first and last stage each hold a copy in buckets
of their own; both strategies reduce them over dp like any other bucket, and
``complete`` then all-reduces just this rank's reduced piece over the
``embedding`` group (the sum is linear, so the order does not matter). Both
ends have the same tp/dp coordinates and the same tied parameters, hence the
same tied bucket sizes and pieces; ``complete`` checks that once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.distributed as dist

from parallel3d import comm
from parallel3d.parallel_state import ParallelState
from parallel3d.zero.buffers import Bucket, FlatBuffer
from parallel3d.zero.memory import MemoryTracker
from parallel3d.zero.reduction import BucketReducer, PendingCollectives
from parallel3d.zero.staging import MAX_STAGING_BUFFERS

__all__ = ["GradSync", "MAX_STAGING_BUFFERS", "REDUCE_SCATTER_MODES"]

# "reduce_scatter" (default): a true reduce-scatter, so stages 1-2 send exactly DDP's bytes.
# "auto" (opt-in, gloo only): an in-place all-reduce of the whole bucket, after which this rank
# keeps its piece. gloo's ring all-reduce is ~2-3x faster than its reduce-scatter at bucket sizes
# (2 ranks, 1 MiB: ~1.1 ms vs ~2-3 ms) though it moves twice the bytes (counted as sent). NCCL
# keeps the reduce-scatter. "all_reduce" forces the all-reduce on any backend.
REDUCE_SCATTER_MODES = ("auto", "reduce_scatter", "all_reduce")


class GradSync(ABC):
    """Reduces the gradients of the parameters in ``params_bufs`` (one FlatBuffer per dtype) over dp.

    ``grad_dtype``: dtype gradients are accumulated and reduced in. ``memory`` receives
    this object's allocations (``gradients``, ``buckets``) and transient ``.grad`` bytes.
    """

    def __init__(self, modules: list[torch.nn.Module], params_bufs: list[FlatBuffer], pstate: ParallelState, *,
                 grad_dtype: torch.dtype, reduce_scatter: str, memory: MemoryTracker) -> None:
        if reduce_scatter not in REDUCE_SCATTER_MODES:
            raise ValueError(f"reduce_scatter={reduce_scatter!r} is not one of {REDUCE_SCATTER_MODES}")
        self.modules = modules
        self.params_bufs = params_bufs
        self.pstate = pstate
        self.grad_dtype = grad_dtype
        self.memory = memory
        self.dp = comm.group_size(pstate, "dp")
        as_all_reduce = reduce_scatter == "all_reduce" or (
            reduce_scatter == "auto" and self.dp > 1 and dist.get_backend(pstate.group("dp")) == "gloo"
        )
        self.pending = PendingCollectives()
        self.reducer = BucketReducer(pstate, as_all_reduce=as_all_reduce, pending=self.pending, memory=memory,
                                     max_temporaries=MAX_STAGING_BUFFERS)
        self._where: dict[int, tuple[int, Bucket, int]] = {}  # id(param) -> (group, bucket, slot index)
        self._tied: list[tuple[int, Bucket]] = []
        self._tied_checked = False
        self._hooks = []
        for g, pb in enumerate(params_bufs):
            for b in pb.layout.buckets:
                if b.tied:
                    self._tied.append((g, b))
                for i, s in enumerate(b.slots):
                    self._where[id(s.param)] = (g, b, i)
                    self._hooks.append(s.param.register_post_accumulate_grad_hook(self._hook))
        self._is_last = True
        self._finished = False
        self._completed = False
        self._closed: set[int] = set()  # params whose last microbatch's gradient has arrived this step

    # ---- engine-facing API ---------------------------------------------------------
    def prepare(self, is_last_microbatch: bool) -> None:
        """Before each backward: whether it completes its chunk's gradient accumulation."""
        self._is_last = bool(is_last_microbatch)

    def finish(self) -> None:
        """Start the reduction of whatever is left (``dp`` group only; safe before pipeline sends)."""
        if self._finished:
            return
        self._launch_leftovers()
        self._finished = True

    def complete(self) -> None:
        """``finish``, wait for every collective, sum tied embeddings over ``embedding``. Idempotent per step."""
        if self._completed:
            return
        self.finish()
        self.pending.drain()
        self._sum_tied()
        self._completed = True

    def reset(self) -> None:
        """Start a new step (the previous step's reduced gradients have been consumed)."""
        self.pending.drain()  # nothing may still write into buffers the next step reuses
        self._is_last = True
        self._finished = False
        self._completed = False
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
        """The DP-mean gradient of the piece of ``bucket`` this rank owns (valid after ``complete``)."""

    @abstractmethod
    def gradient_tensors(self) -> list[torch.Tensor]:
        """The persistent gradient storage (buffers or shards), for ``memory_bytes``."""

    def staging_buffers(self) -> list[torch.Tensor]:
        return []

    # ---- strategy hooks ----------------------------------------------------------------
    @abstractmethod
    def _on_grad_ready(self, group: int, bucket: Bucket, index: int, param: torch.nn.Parameter) -> None:
        """``param.grad`` holds a new contribution (slot ``bucket.slots[index]``)."""

    @abstractmethod
    def _launch_leftovers(self) -> None:
        """Called once by ``finish``: launch every reduction not started yet, in bucket order."""

    @abstractmethod
    def _reset_step(self) -> None: ...

    @abstractmethod
    def _zero_grads(self) -> None: ...

    # ---- shared machinery -------------------------------------------------------------
    def _hook(self, param: torch.nn.Parameter) -> None:
        g, b, i = self._where[id(param)]
        if self._finished or id(param) in self._closed:
            when = "finish()" if self._finished else "its last microbatch's backward"
            raise RuntimeError(
                f"ZeRO: gradient of {b.slots[i].name} arrived after {when} in this step (its bucket may "
                f"already be reducing); with gradient accumulation call "
                f"grad_sync.prepare(is_last_microbatch=False) before all but the last backward"
            )
        if self._is_last:
            self._closed.add(id(param))
        self._on_grad_ready(g, b, i, param)

    def _sum_tied(self) -> None:
        """Sum the reduced tied-embedding pieces over the ``embedding`` group (first + last stage)."""
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
        device = self.params_bufs[0].data.device
        hi = torch.tensor(sig, dtype=torch.int64, device=device)
        lo = hi.clone()
        comm.all_reduce(hi, self.pstate, "embedding", op=dist.ReduceOp.MAX)
        comm.all_reduce(lo, self.pstate, "embedding", op=dist.ReduceOp.MIN)
        if not torch.equal(hi, lo):
            raise RuntimeError(
                f"rank {self.pstate.rank}: the tied-embedding buckets differ between the first and last "
                f"pipeline stage (signature min {lo.tolist()} vs max {hi.tolist()}); both ends must hold the "
                f"same tied parameters"
            )
