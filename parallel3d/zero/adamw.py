"""AdamW with decoupled weight decay on flat fp32 shards.

Matches ``torch.optim.AdamW`` (non-amsgrad, non-capturable) element for element:

    p <- p * (1 - lr * wd)                       (decayed ranges only)
    m <- lerp(m, g, 1 - beta1)
    v <- beta2 * v + (1 - beta2) * g^2
    p <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

Both backends are ``kernels.adamw.adamw_flat_`` (one implementation of the formula):
``"torch"`` forces its torch reference, ``"auto"``/``"kernels"`` let ``kernels`` pick
(Triton on CUDA or under TRITON_INTERPRET=1, else the same torch reference).

``host_adamw_flat_`` is the update offloaded optimizer states run on the host: torch's
fused CPU AdamW (one vectorised pass, ~5x the torch reference's speed on one core),
through its public functional form ``torch.optim.adamw.adamw(fused=True)``.
"""

from __future__ import annotations

import os
from typing import Callable

import torch
from torch.optim.adamw import adamw as torch_functional_adamw

BACKENDS = ("auto", "torch", "kernels")


def _kernel_adamw():  # noqa: ANN202 - the kernels.adamw module
    """``kernels.adamw``, imported on first use as ``kernels.dispatch`` imports its kernels: it imports
    triton, which importing this package (the planner reads ``zero.options``) must not need."""
    from kernels import adamw

    return adamw


def adamw_flat_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                **hyper: float) -> None:
    """One Adam update of the flat fp32 tensors in place with torch ops (weight decay applied by
    the caller); ``hyper`` are ``step, lr, beta1, beta2, eps``."""
    _kernel_adamw().adamw_flat_(param, grad, exp_avg, exp_avg_sq, backend="torch", **hyper)


def host_adamw_flat_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                     step: int, lr: float, beta1: float, beta2: float, eps: float) -> None:
    """``adamw_flat_`` for host (CPU) fp32 tensors with torch's fused CPU kernel (no weight decay)."""
    # The functional form increments the step tensor before the update: pass the count before it.
    steps = [torch.tensor(float(step - 1))]
    torch_functional_adamw([param], [grad], [exp_avg], [exp_avg_sq], [], steps, fused=True, amsgrad=False,
                           beta1=beta1, beta2=beta2, lr=lr, weight_decay=0.0, eps=eps, maximize=False)


def resolve_backend(name: str, device: torch.device | None = None) -> Callable[..., None]:
    """The flat-update function for ``fused_adamw_backend=name`` on ``device``.

    ``"auto"`` on a CPU device (no Triton interpreter) is torch's fused CPU kernel: the torch
    reference makes ~6 passes over each shard with temporaries, the fused kernel one."""
    if name not in BACKENDS:
        raise ValueError(f"fused_adamw_backend={name!r} is not one of {BACKENDS}")
    if name == "torch":
        return adamw_flat_
    if name == "auto" and device is not None and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return host_adamw_flat_
    return _kernel_adamw().adamw_flat_
