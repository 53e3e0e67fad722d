"""``F.linear`` whose weight-gradient GEMM can be deferred to a zero-bubble ``W``.

``deferrable_linear(x, w, b, deferral)`` is ``F.linear(x, w, b)`` for any leading shape
``[..., in] -> [..., out]``. Its backward computes the input gradient ``grad @ w`` and
either returns the weight and bias gradients (``grad^T x`` and ``grad`` summed over
rows: the expressions autograd uses for ``F.linear``) or, while a split backward's ``B``
is open on ``deferral`` (``parallel3d.deferred_grads``), queues them, keeping ``x`` and
``grad`` alive until ``W``. Either way the same expressions run on the same tensors, so
a deferred gradient is bitwise the undeferred one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from parallel3d.deferred_grads import WeightGradDeferral

__all__ = ["deferrable_linear", "linear_weight_grads"]


def linear_weight_grads(x: torch.Tensor, grad: torch.Tensor, need_weight: bool, need_bias: bool
                        ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(grad^T x, grad summed over rows)`` of ``y = x w^T + b`` (rows: every leading dim), each if needed."""
    rows = grad.reshape(-1, grad.shape[-1])
    weight = rows.t().mm(x.reshape(-1, x.shape[-1])) if need_weight else None
    return weight, rows.sum(0) if need_bias else None


class _DeferrableLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, deferral):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        # The parameters themselves, for their marks and gradient edges: a saved tensor may come
        # back as another object (recompute hands out the recomputed forward's copy).
        ctx.params = (weight, bias)
        ctx.deferral = deferral
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        needs_x, needs_w, needs_b = ctx.needs_input_grad[:3]
        grad_x = grad.matmul(weight) if needs_x else None
        if not (needs_w or needs_b):
            return grad_x, None, None, None

        def compute() -> tuple[torch.Tensor | None, torch.Tensor | None]:
            return linear_weight_grads(x, grad, needs_w, needs_b)

        deferral: WeightGradDeferral | None = ctx.deferral
        if deferral is not None and deferral.defer(ctx.params, compute, (x, grad)):
            return grad_x, None, None, None
        return (grad_x, *compute(), None)


def deferrable_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      deferral: WeightGradDeferral | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; its weight/bias gradients go to ``deferral`` while a ``B`` is open."""
    return _DeferrableLinear.apply(x, weight, bias, deferral)
