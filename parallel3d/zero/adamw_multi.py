"""One vectorised AdamW update over every piece of a rank's shard at once.

The update of ``adamw``'s flat formula, applied to lists of tensors in one call
instead of a Python loop over buckets and segments:

- ``TensorLists`` holds, per run of this rank's shard that is either all
  weight-decayed or all not (adjacent segments of a bucket's piece merged, the
  piece's zero padding joined to a neighbour), in-place views of the fp32
  master, both moments and the gradient. Built once per gradient storage.
- ``multi_tensor_adamw_`` scales the gradients by ``coef`` in place (fp32 copies
  first where they are held in another dtype), decays the decayed masters (``p *= 1 - lr * wd``, before
  the Adam update, as torch does; on a CPU inside torch's fused kernel) and runs Adam on all lists with one of:
  ``fused`` torch's fused AdamW kernel (CPU or CUDA: one pass over every tensor,
  torch's own implementation), ``foreach`` torch's ``_foreach_*`` ops in
  ``kernels.adamw.adamw_step_reference``'s order of operations (the ``torch``
  backend: element for element the reference), or ``per_tensor`` (``kernels``'s
  Triton kernel per tensor: several launches, used only when asked for).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.optim.adamw import adamw as torch_functional_adamw

from parallel3d.zero.buffers import Bucket, BufferLayout

MULTI_KINDS = ("fused", "foreach", "per_tensor")


def step_temporaries(grad_is_fp32: bool, kind: str) -> int:
    """fp32 tensors of the shard's size ``multi_tensor_adamw_`` allocates (``planning.memory`` counts
    them): the fp32 copy of gradients held in another dtype, and ``foreach``'s ``sqrt(v)``. The clip
    coefficient scales the gradients in place and the fused kernel allocates nothing of that size
    (``tests/test_zero_grad_norm.py`` measures a step's allocations against this)."""
    if kind not in MULTI_KINDS:
        raise ValueError(f"multi-tensor AdamW kind {kind!r} is not one of {MULTI_KINDS}")
    return (0 if grad_is_fp32 else 1) + (1 if kind == "foreach" else 0)


@dataclass
class TensorLists:
    """Views of the runs of the shard; ``decay[i]`` says whether run ``i`` is weight-decayed."""

    masters: list[torch.Tensor] = field(default_factory=list)
    exp_avgs: list[torch.Tensor] = field(default_factory=list)
    exp_avg_sqs: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    decay: list[bool] = field(default_factory=list)
    # The fused kernel's step count per run, kept across steps as torch.optim.AdamW keeps state["step"]
    # (the kernel adds 1 before using it): refilled only when they do not hold the previous step.
    steps: list[torch.Tensor] = field(default_factory=list)
    steps_done: int | None = None  # the step count ``steps`` hold (None: not filled)


def decay_runs(bucket: Bucket, weight_decay: bool) -> list[tuple[int, int, bool]]:
    """``(lo, hi, decayed)`` runs covering ``[0, piece_size)`` of ``bucket``'s piece (piece coordinates)."""
    if not weight_decay or not bucket.segments:
        return [(0, bucket.piece_size, False)] if bucket.piece_size else []
    runs: list[list] = []
    for seg in bucket.segments:
        lo, hi = seg.shard_start - bucket.shard_offset, seg.shard_end - bucket.shard_offset
        if runs and runs[-1][2] == seg.slot.decay:
            runs[-1][1] = hi
        else:
            runs.append([lo, hi, seg.slot.decay])
    runs[0][0] = 0  # padding (zero gradient, zero master) goes with its neighbour: decaying 0 is 0
    runs[-1][1] = bucket.piece_size
    for a, b in zip(runs, runs[1:]):
        b[0] = a[1]
    return [tuple(r) for r in runs]


def build_lists(layouts: list[BufferLayout], read_piece: Callable, grad_piece: Callable,
                weight_decay: bool) -> TensorLists:
    """Views for every run of every bucket's piece; ``read_piece(g, b)`` gives (master, m, v)."""
    out = TensorLists()
    for g, layout in enumerate(layouts):
        for b in layout.buckets:
            master, m, v = read_piece(g, b)
            grad = grad_piece(g, b)
            for lo, hi, decayed in decay_runs(b, weight_decay):
                out.masters.append(master[lo:hi])
                out.exp_avgs.append(m[lo:hi])
                out.exp_avg_sqs.append(v[lo:hi])
                out.grads.append(grad[lo:hi])
                out.decay.append(decayed)
    return out


@torch.no_grad()
def multi_tensor_adamw_(lists: TensorLists, *, coef: float, step: int, lr: float, beta1: float, beta2: float,
                        eps: float, weight_decay: float, kind: str,
                        per_tensor: Callable[..., None] | None = None) -> None:
    """One AdamW step of every run in ``lists`` (module doc); ``coef`` multiplies the gradients first."""
    if kind not in MULTI_KINDS:
        raise ValueError(f"multi-tensor AdamW kind {kind!r} is not one of {MULTI_KINDS}")
    if not lists.masters:
        return
    grads = lists.grads
    if any(g.dtype != torch.float32 for g in grads):
        grads = [g.float() for g in grads]  # STEP_TEMPORARIES: one fp32 copy of the shard
    if coef != 1.0:
        # In place, as torch's clip_grad_norm_ and GradScaler.unscale_ scale ``.grad``: these are this
        # step's reduced gradients (or the fp32 copies above), read by nothing after the update.
        torch._foreach_mul_(grads, coef)
    decays = bool(weight_decay and lr)
    # On a CPU torch's fused kernel decays a run itself (p *= 1 - lr * wd before Adam, bitwise the
    # _foreach_mul_ below: tests/test_zero_adamw_fused_decay.py), saving that pass over the decayed
    # masters; on other devices its arithmetic is not checked here, so they keep the separate pass.
    in_kernel = kind == "fused" and decays and lists.masters[0].device.type == "cpu"
    if decays and not in_kernel:
        decayed = [p for p, d in zip(lists.masters, lists.decay) if d]
        if decayed:
            torch._foreach_mul_(decayed, 1.0 - lr * weight_decay)
    if kind == "fused":
        steps = _step_counts(lists, step)
        for flag in (True, False) if in_kernel else (None,):
            idx = [i for i, d in enumerate(lists.decay) if flag is None or d == flag]
            if idx:
                _fused(lists, grads, steps, idx, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                       weight_decay=weight_decay if flag else 0.0)
        lists.steps_done = step  # every run's count was incremented once
        return
    if kind == "foreach":
        torch._foreach_lerp_(lists.exp_avgs, grads, 1.0 - beta1)
        torch._foreach_mul_(lists.exp_avg_sqs, beta2)
        torch._foreach_addcmul_(lists.exp_avg_sqs, grads, grads, value=1.0 - beta2)
        denom = torch._foreach_sqrt(lists.exp_avg_sqs)
        torch._foreach_div_(denom, math.sqrt(1.0 - beta2**step))
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(lists.masters, lists.exp_avgs, denom, value=-lr / (1.0 - beta1**step))
    else:
        assert per_tensor is not None
        for p, g, m, v in zip(lists.masters, grads, lists.exp_avgs, lists.exp_avg_sqs):
            per_tensor(p, g, m, v, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps)


def _step_counts(lists: TensorLists, step: int) -> list[torch.Tensor]:
    """The runs' step tensors holding ``step - 1`` (the functional form increments each before using it)."""
    if len(lists.steps) != len(lists.masters):
        lists.steps = [torch.zeros((), device=m.device) for m in lists.masters]
        lists.steps_done = None
    if lists.steps_done != step - 1:  # first use, a skipped or failed update, a loaded checkpoint's count
        for t in lists.steps:
            t.fill_(float(step - 1))
    return lists.steps


def _fused(lists: TensorLists, grads: list[torch.Tensor], steps: list[torch.Tensor], idx: list[int], *, lr: float,
           beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """torch's fused AdamW on the runs ``idx`` of ``lists`` (``steps``: their counts, ``_step_counts``)."""
    def pick(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return tensors if len(idx) == len(tensors) else [tensors[i] for i in idx]

    torch_functional_adamw(pick(lists.masters), pick(grads), pick(lists.exp_avgs), pick(lists.exp_avg_sqs), [],
                           pick(steps), fused=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=lr,
                           weight_decay=weight_decay, eps=eps, maximize=False)
