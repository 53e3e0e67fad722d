"""The arithmetic of one optimizer step over the owned pieces: the global gradient norm and
AdamW where the state lives.

Invariant: every rank reads only its own pieces (``grad_piece`` / ``param_piece`` in shard
coordinates) and joins the same norm reductions in the same order, so after ``AdamWUpdate.apply``
the replicas' pieces are what one process running torch's AdamW on the whole model would hold.
On the device the update is one vectorised call over every piece (``adamw_multi``); offloaded
state streams chunk by chunk through host memory (``states.update_chunks``).
"""

from __future__ import annotations

import math
import os
from typing import Callable

import torch

from parallel3d.parallel_state import ParallelState
from parallel3d.zero import clip
from parallel3d.zero.adamw import host_adamw_flat_, resolve_backend
from parallel3d.zero.adamw_multi import TensorLists, build_lists, multi_tensor_adamw_
from parallel3d.zero.buffers import Bucket, BufferLayout, shard_slice
from parallel3d.zero.states import DeviceStates, OptimizerStates, StateChunk

PieceOf = Callable[[int, Bucket], torch.Tensor]
__all__ = ["AdamWUpdate", "global_grad_norm", "multi_kind"]


def multi_kind(backend: str, device: torch.device) -> str:
    """How the vectorised update runs for ``fused_adamw_backend=backend`` (``adamw_multi``): "torch" is
    torch's foreach ops in the reference's order; "auto" torch's fused AdamW (CPU or CUDA) unless the
    Triton interpreter is on; "kernels" our Triton kernel per tensor."""
    if backend == "torch":
        return "foreach"
    if backend == "auto" and device.type in ("cpu", "cuda") and os.environ.get("TRITON_INTERPRET") != "1":
        return "fused"
    return "per_tensor"


def global_grad_norm(layouts: list[BufferLayout], grad_piece: PieceOf, pstate: ParallelState, *,
                     kinds: tuple[str, ...], stage_of_kind: dict[str, int], inv_scale: float,
                     device: torch.device) -> float:
    """The job's gradient norm (of the unscaled, replica-averaged gradient), inf/nan if any rank
    holds a non-finite element. Every kind in ``kinds`` is reduced on every rank, even one holding
    no parameter of that kind (a dense pipeline stage, a dense model): its groups span stages."""
    local_sq = {kind: torch.zeros((), dtype=torch.float64, device=device) for kind in kinds}
    for g, layout in enumerate(layouts):
        sq = local_sq.setdefault(layout.reduce_kind, torch.zeros((), dtype=torch.float64, device=device))
        for b in layout.buckets:
            piece = grad_piece(g, b)
            sq += clip.piece_sq_sum(piece, b, inv_scale)
            if not clip.uncounted_all_finite(piece, b):
                # Also in elements another rank counts in the norm (e.g. TP replicas):
                # an inf in the sum makes every rank of the job see the overflow.
                sq += math.inf
    return clip.reduce_norm(local_sq, pstate, sharded={kind: stage > 0 for kind, stage in stage_of_kind.items()})


class AdamWUpdate:
    """Decoupled-decay AdamW on the owned pieces (module doc); ``step`` counts applied updates."""

    def __init__(self, *, betas: tuple[float, float], eps: float, weight_decay: float, fused_adamw_backend: str,
                 device: torch.device) -> None:
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay
        self._adamw = resolve_backend(fused_adamw_backend, device)
        self._multi_kind = multi_kind(fused_adamw_backend, device)
        self._lists: TensorLists | None = None
        self._lists_key: tuple[int, ...] = ()

    def apply(self, layouts: list[BufferLayout], states: OptimizerStates, grad_piece: PieceOf,
              param_piece: PieceOf, *, coef: float, lr: float, step: int) -> None:
        """Update every piece with gradient ``coef * grad_piece`` (``step``: bias correction's count)."""
        if isinstance(states, DeviceStates):
            self._update_all(layouts, states, grad_piece, param_piece, coef, lr, step)
            return
        update = host_adamw_flat_ if states.on_host else self._adamw
        for chunk in states.update_chunks(grad_piece, param_piece):
            self._update_chunk(chunk, coef, lr, step, update)

    def _update_all(self, layouts: list[BufferLayout], states: DeviceStates, grad_piece: PieceOf,
                    param_piece: PieceOf, coef: float, lr: float, step: int) -> None:
        """One vectorised AdamW over every piece (``adamw_multi``); masters of bf16/fp16 models are
        copied into the parameters' pieces afterwards."""
        key = tuple(grad_piece(g, layout.buckets[0]).data_ptr() for g, layout in enumerate(layouts))
        if self._lists is None or key != self._lists_key:  # views of persistent tensors: built once
            self._lists = build_lists(layouts, states.read_piece, grad_piece, bool(self.weight_decay))
            self._lists_key = key
        beta1, beta2 = self.betas
        multi_tensor_adamw_(self._lists, coef=coef, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=self.eps,
                            weight_decay=self.weight_decay, kind=self._multi_kind, per_tensor=self._adamw)
        for g, master in enumerate(states.masters):
            if master is not None:
                for b in layouts[g].buckets:
                    param_piece(g, b).copy_(shard_slice(master, b))

    def _update_chunk(self, chunk: StateChunk, coef: float, lr: float, step: int,
                      update: Callable[..., None]) -> None:
        b, lo, hi = chunk.bucket, chunk.lo, chunk.hi
        grad = chunk.grad.float() * coef
        if self.weight_decay and lr:
            for seg in b.segments:
                if not seg.slot.decay:
                    continue
                start = max(seg.shard_start - b.shard_offset, lo)
                end = min(seg.shard_end - b.shard_offset, hi)
                if start < end:  # decoupled decay, before the Adam update (as torch does)
                    chunk.master[start - lo : end - lo].mul_(1 - lr * self.weight_decay)
        beta1, beta2 = self.betas
        update(chunk.master, grad, chunk.exp_avg, chunk.exp_avg_sq, step=step, lr=lr, beta1=beta1,
               beta2=beta2, eps=self.eps)
