"""SwiGLU activation: ``y = silu(gate) * up`` with ``silu(a) = a * sigmoid(a)``.

Shapes: ``gate`` and ``up`` have the same shape and dtype; ``y`` too. Math is fp32 in
registers. Forward keeps only the two inputs for backward (no silu(gate) or sigmoid
tensor): backward recomputes the sigmoid while reading them,
``d_gate = dy * up * s * (1 + gate * (1 - s))``, ``d_up = dy * silu(gate)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import swiglu_reference  # noqa: F401 (re-exported)

ELEMENTWISE_BLOCK = 2048


@triton.jit
def _swiglu_fwd(GATE, UP, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(GATE + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(UP + offs, mask=mask, other=0.0).to(tl.float32)
    y = a * tl.sigmoid(a) * b
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(DY, GATE, UP, DGATE, DUP, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(GATE + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(UP + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(a)
    silu = a * s
    tl.store(DGATE + offs, (dy * b * s * (1.0 + a * (1.0 - s))).to(DGATE.dtype.element_ty), mask=mask)
    tl.store(DUP + offs, (dy * silu).to(DUP.dtype.element_ty), mask=mask)


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, block_size: int | None) -> torch.Tensor:
        gate, up = gate.contiguous(), up.contiguous()
        y = torch.empty_like(gate)
        block = block_size or ELEMENTWISE_BLOCK
        n = gate.numel()
        if n:
            _swiglu_fwd[(triton.cdiv(n, block),)](gate, up, y, n, BLOCK=block, num_warps=8)
        ctx.save_for_backward(gate, up)
        ctx.block = block
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        gate, up = ctx.saved_tensors
        dy = dy.contiguous()
        d_gate, d_up = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        if n:
            _swiglu_bwd[(triton.cdiv(n, ctx.block),)](dy, gate, up, d_gate, d_up, n, BLOCK=ctx.block, num_warps=8)
        return d_gate, d_up, None


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, block_size: int | None = None) -> torch.Tensor:
    """Triton ``silu(gate) * up`` (differentiable in both); see the module docstring."""
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(
            f"swiglu: gate {tuple(gate.shape)} {gate.dtype} {gate.device} and up {tuple(up.shape)} {up.dtype} "
            f"{up.device} must have the same shape, dtype and device"
        )
    return SwiGLUFunction.apply(gate, up, block_size)
