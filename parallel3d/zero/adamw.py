"""AdamW with decoupled weight decay on flat fp32 shards.

Matches ``torch.optim.AdamW`` (non-amsgrad, non-capturable) element for element:

    p <- p * (1 - lr * wd)                       (decayed ranges only)
    m <- lerp(m, g, 1 - beta1)
    v <- beta2 * v + (1 - beta2) * g^2
    p <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

Both backends are ``kernels.adamw.adamw_flat_`` (one implementation of the formula):
``"torch"`` forces its torch reference, ``"auto"``/``"kernels"`` let ``kernels`` pick
(Triton on CUDA or under TRITON_INTERPRET=1, else the same torch reference).
"""

from __future__ import annotations

from typing import Callable

import torch

from kernels import adamw as kernel_adamw

BACKENDS = ("auto", "torch", "kernels")


def adamw_flat_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                **hyper: float) -> None:
    """One Adam update of the flat fp32 tensors in place with torch ops (weight decay applied by
    the caller); ``hyper`` are ``step, lr, beta1, beta2, eps``."""
    kernel_adamw.adamw_flat_(param, grad, exp_avg, exp_avg_sq, backend="torch", **hyper)


def resolve_backend(name: str) -> Callable[..., None]:
    """The flat-update function for ``fused_adamw_backend=name``."""
    if name not in BACKENDS:
        raise ValueError(f"fused_adamw_backend={name!r} is not one of {BACKENDS}")
    return adamw_flat_ if name == "torch" else kernel_adamw.adamw_flat_
