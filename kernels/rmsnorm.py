"""RMSNorm over the last dim: ``y = x * rsqrt(mean(x^2) + eps) * weight``.

Shapes: ``x [..., N]`` (fp32, bf16 or fp16), ``weight [N]``; ``y`` has x's shape and dtype.
Statistics are fp32 whatever the input dtype. Forward saves ``x`` and one fp32 ``rstd``
per row (no normalised copy). Backward: ``dx`` row by row; ``dw`` is reduced over rows in
two deterministic stages: every program sums its contiguous block of rows into one fp32
row of ``dw_partial [programs, N]``, then the host sums those rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import rms_norm_reference  # noqa: F401 (re-exported)
from kernels.norm_rows import (
    as_rows,
    backward_buffers,
    check_norm_args,
    forward_buffers,
    forward_row,
    load_f32,
    program_rows,
)
from kernels.runtime import num_warps_for

__all__ = ["RMSNormFunction", "as_rows", "check_norm_args", "rms_norm", "rms_norm_reference"]


@triton.jit
def _rms_norm_fwd(X, W, Y, RSTD, stride_x, stride_y, N, eps, BLOCK_N: tl.constexpr, SINGLE_BLOCK: tl.constexpr):
    row, x_row, y_row = forward_row(X, Y, stride_x, stride_y)
    if SINGLE_BLOCK:
        cols = tl.arange(0, BLOCK_N)
        mask = cols < N
        x = load_f32(x_row, cols, mask)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
        tl.store(y_row + cols, (x * rstd * load_f32(W, cols, mask)).to(Y.dtype.element_ty), mask=mask)
    else:
        sq = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            x = load_f32(x_row, cols, cols < N)
            sq += x * x
        rstd = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / N + eps)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = cols < N
            y = load_f32(x_row, cols, mask) * rstd * load_f32(W, cols, mask)
            tl.store(y_row + cols, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _rms_norm_bwd(
    DY, X, W, RSTD, DX, DW_PARTIAL, stride_dy, stride_x, stride_dx, M, N, rows_per_program,
    BLOCK_N: tl.constexpr, SINGLE_BLOCK: tl.constexpr,
):
    # dx = rstd * (w*dy - xhat * mean(xhat * w*dy)),  dw = sum_rows dy * xhat
    first_row, n_rows = program_rows(rows_per_program, M)
    dw_row = DW_PARTIAL + tl.program_id(0).to(tl.int64) * N
    if SINGLE_BLOCK:
        cols = tl.arange(0, BLOCK_N)
        mask = cols < N
        w = load_f32(W, cols, mask)
        dw = tl.zeros([BLOCK_N], dtype=tl.float32)
        for i in range(0, n_rows):
            row64 = first_row + i
            rstd = tl.load(RSTD + row64)
            xhat = load_f32(X + row64 * stride_x, cols, mask) * rstd
            dy = load_f32(DY + row64 * stride_dy, cols, mask)
            wdy = w * dy
            c = tl.sum(xhat * wdy, axis=0) / N
            tl.store(DX + row64 * stride_dx + cols, ((wdy - xhat * c) * rstd).to(DX.dtype.element_ty), mask=mask)
            dw += dy * xhat
        tl.store(dw_row + cols, dw, mask=mask)
    else:
        # DW_PARTIAL was zeroed by the host; this program owns row `pid` of it.
        for i in range(0, n_rows):
            row64 = first_row + i
            rstd = tl.load(RSTD + row64)
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for start in range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                mask = cols < N
                xhat = load_f32(X + row64 * stride_x, cols, mask) * rstd
                acc += xhat * load_f32(W, cols, mask) * load_f32(DY + row64 * stride_dy, cols, mask)
            c = tl.sum(acc, axis=0) / N
            for start in range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                mask = cols < N
                xhat = load_f32(X + row64 * stride_x, cols, mask) * rstd
                dy = load_f32(DY + row64 * stride_dy, cols, mask)
                dx = (load_f32(W, cols, mask) * dy - xhat * c) * rstd
                tl.store(DX + row64 * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
                tl.store(dw_row + cols, load_f32(dw_row, cols, mask) + dy * xhat, mask=mask)


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, block_size: int | None) -> torch.Tensor:
        x2, y, block, (rstd,) = forward_buffers(x, block_size, num_stats=1)
        m, n = x2.shape
        w = weight.contiguous()
        if m > 0:
            _rms_norm_fwd[(m,)](
                x2, w, y, rstd, x2.stride(0), y.stride(0), n, eps,
                BLOCK_N=block, SINGLE_BLOCK=block >= n, num_warps=num_warps_for(block),
            )
        ctx.save_for_backward(x2, w, rstd)
        ctx.block = block
        ctx.x_shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, w, rstd = ctx.saved_tensors
        m, n = x2.shape
        dy2, dx, programs, (dw_partial,) = backward_buffers(x2, dy, num_partials=1)
        if m > 0:
            _rms_norm_bwd[(programs,)](
                dy2, x2, w, rstd, dx, dw_partial, dy2.stride(0), x2.stride(0), dx.stride(0), m, n,
                triton.cdiv(m, programs), BLOCK_N=ctx.block, SINGLE_BLOCK=ctx.block >= n,
                num_warps=num_warps_for(ctx.block),
            )
        dw = dw_partial.sum(0).to(w.dtype)
        return dx.view(ctx.x_shape), dw, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, block_size: int | None = None) -> torch.Tensor:
    """Triton RMSNorm (differentiable in x and weight); see the module docstring."""
    check_norm_args("rms_norm", x, weight)
    return RMSNormFunction.apply(x, weight, eps, block_size)
