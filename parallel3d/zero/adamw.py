"""AdamW with decoupled weight decay on flat fp32 shards.

Matches ``torch.optim.AdamW`` (non-amsgrad, non-capturable) element for element:

    p <- p * (1 - lr * wd)                       (decayed ranges only)
    m <- lerp(m, g, 1 - beta1)
    v <- beta2 * v + (1 - beta2) * g^2
    p <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

``backend="auto"`` uses ``kernels.adamw`` when that module provides a fused
flat update and otherwise this torch implementation.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

BACKENDS = ("auto", "torch", "kernels")


def adamw_flat_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
) -> None:
    """One Adam update of the flat fp32 tensors in place (weight decay applied by the caller)."""
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size = lr / (1 - beta1**step)
    denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def resolve_backend(name: str) -> Callable[..., None]:
    """The flat-update function for ``fused_adamw_backend=name``."""
    if name not in BACKENDS:
        raise ValueError(f"fused_adamw_backend={name!r} is not one of {BACKENDS}")
    if name == "torch":
        return adamw_flat_
    try:
        from kernels import adamw as kernel_module  # written by the kernels issue
        fused = getattr(kernel_module, "adamw_flat_", None)
    except ImportError:
        fused = None
    if fused is None:
        if name == "kernels":
            raise ValueError(
                "fused_adamw_backend='kernels' but kernels.adamw.adamw_flat_ is not available; use 'auto' or 'torch'"
            )
        return adamw_flat_
    return fused
