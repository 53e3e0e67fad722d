"""AdamW with decoupled weight decay on flat fp32 shards.

Matches ``torch.optim.AdamW`` (non-amsgrad, non-capturable) element for element:

    p <- p * (1 - lr * wd)                       (decayed ranges only)
    m <- lerp(m, g, 1 - beta1)
    v <- beta2 * v + (1 - beta2) * g^2
    p <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

``backend="auto"`` uses ``kernels.adamw``'s fused flat update when that module
provides one, and otherwise (``"torch"``) its torch reference
(``kernels.adamw.adamw_step_reference``): one implementation of the formula serves both.
"""

from __future__ import annotations

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
    from kernels.adamw import adamw_step_reference

    adamw_step_reference(param, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                         weight_decay=0.0, step=step)


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
