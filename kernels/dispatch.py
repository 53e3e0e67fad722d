"""One entry point per fused op; picks Triton, apex or the torch reference.

Conventions (shared by every backend):
- ``rms_norm(x, weight, eps)`` / ``layer_norm(x, weight, bias, eps)``: normalise the last dim.
- ``apply_rope(q, k, cos, sin)``: q ``[b, s, hq, d]``, k ``[b, s, hk, d]``, cos/sin ``[s, d/2]``;
  the "rotate half" convention of HF Llama: ``(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)``
  with ``x1 = x[..., :d/2]``, ``x2 = x[..., d/2:]``. Returns ``(q_rot, k_rot)``.
- ``swiglu(gate, up) = silu(gate) * up``.
- ``cross_entropy(logits, targets, ignore_index=-100)``: mean over non-ignored tokens.

``backend`` is ``auto`` (Triton on CUDA or under TRITON_INTERPRET=1, else torch),
``triton``, ``apex`` or ``torch``; an unavailable choice is a clear error.
(This file currently holds only the torch references; the Triton paths land with the kernels issue.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, backend: str = "auto") -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float = 1e-5, backend: str = "auto"
) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    def rot(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        c = cos[None, :, None, :].to(x.dtype)
        s = sin[None, :, None, :].to(x.dtype)
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)

    return rot(q), rot(k)


def swiglu(gate: torch.Tensor, up: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    return F.silu(gate) * up


def cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, backend: str = "auto"
) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=ignore_index)
