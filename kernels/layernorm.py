"""LayerNorm over the last dim: ``y = (x - mean) * rstd * weight + bias``.

Shapes: ``x [..., N]`` (fp32, bf16 or fp16), ``weight [N]``, ``bias [N]`` or None; ``y`` has
x's shape and dtype. Mean and rstd are fp32 (one each per row) and are saved for backward
with ``x``. Backward: ``dx`` per row; ``dw`` and ``db`` are reduced over rows in two
deterministic stages (per-program fp32 partial rows, then a host sum), as in rmsnorm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import layer_norm_reference  # noqa: F401 (re-exported)
from kernels.norm_rows import (
    backward_buffers,
    check_norm_args,
    forward_buffers,
    forward_row,
    load_f32,
    program_rows,
)
from kernels.runtime import num_warps_for


@triton.jit
def _affine(xhat, W, B, cols, mask, HAS_BIAS: tl.constexpr):
    y = xhat * load_f32(W, cols, mask)
    if HAS_BIAS:
        y += load_f32(B, cols, mask)
    return y


@triton.jit
def _layer_norm_fwd(
    X, W, B, Y, MEAN, RSTD, stride_x, stride_y, N, eps,
    BLOCK_N: tl.constexpr, SINGLE_BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    row, x_row, y_row = forward_row(X, Y, stride_x, stride_y)
    if SINGLE_BLOCK:
        cols = tl.arange(0, BLOCK_N)
        mask = cols < N
        x = load_f32(x_row, cols, mask)
        mean = tl.sum(x, axis=0) / N
        xc = tl.where(mask, x - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / N + eps)
        y = _affine(xc * rstd, W, B, cols, mask, HAS_BIAS)
        tl.store(y_row + cols, y.to(Y.dtype.element_ty), mask=mask)
    else:
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            total += load_f32(x_row, cols, cols < N)
        mean = tl.sum(total, axis=0) / N
        # Second pass over centred values: the one-pass E[x^2] - mean^2 loses digits.
        sq = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = cols < N
            xc = tl.where(mask, load_f32(x_row, cols, mask) - mean, 0.0)
            sq += xc * xc
        rstd = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / N + eps)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = cols < N
            y = _affine((load_f32(x_row, cols, mask) - mean) * rstd, W, B, cols, mask, HAS_BIAS)
            tl.store(y_row + cols, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)


@triton.jit
def _layer_norm_bwd(
    DY, X, W, MEAN, RSTD, DX, DW_PARTIAL, DB_PARTIAL, stride_dy, stride_x, stride_dx, M, N, rows_per_program,
    BLOCK_N: tl.constexpr, SINGLE_BLOCK: tl.constexpr,
):
    # dx = rstd * (w*dy - mean(w*dy) - xhat * mean(xhat * w*dy)); dw = sum dy*xhat; db = sum dy
    first_row, n_rows = program_rows(rows_per_program, M)
    dw_row = DW_PARTIAL + tl.program_id(0).to(tl.int64) * N
    db_row = DB_PARTIAL + tl.program_id(0).to(tl.int64) * N
    if SINGLE_BLOCK:
        cols = tl.arange(0, BLOCK_N)
        mask = cols < N
        w = load_f32(W, cols, mask)
        dw = tl.zeros([BLOCK_N], dtype=tl.float32)
        db = tl.zeros([BLOCK_N], dtype=tl.float32)
        for i in range(0, n_rows):
            row64 = first_row + i
            rstd = tl.load(RSTD + row64)
            xhat = tl.where(mask, (load_f32(X + row64 * stride_x, cols, mask) - tl.load(MEAN + row64)) * rstd, 0.0)
            dy = load_f32(DY + row64 * stride_dy, cols, mask)
            wdy = w * dy
            c1 = tl.sum(xhat * wdy, axis=0) / N
            c2 = tl.sum(wdy, axis=0) / N
            dx = (wdy - c2 - xhat * c1) * rstd
            tl.store(DX + row64 * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
            dw += dy * xhat
            db += dy
        tl.store(dw_row + cols, dw, mask=mask)
        tl.store(db_row + cols, db, mask=mask)
    else:
        # The partial buffers were zeroed by the host; this program owns row `pid` of each.
        for i in range(0, n_rows):
            row64 = first_row + i
            mean = tl.load(MEAN + row64)
            rstd = tl.load(RSTD + row64)
            acc1 = tl.zeros([BLOCK_N], dtype=tl.float32)
            acc2 = tl.zeros([BLOCK_N], dtype=tl.float32)
            for start in range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                mask = cols < N
                wdy = load_f32(W, cols, mask) * load_f32(DY + row64 * stride_dy, cols, mask)
                acc1 += tl.where(mask, (load_f32(X + row64 * stride_x, cols, mask) - mean) * rstd, 0.0) * wdy
                acc2 += wdy
            c1 = tl.sum(acc1, axis=0) / N
            c2 = tl.sum(acc2, axis=0) / N
            for start in range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                mask = cols < N
                dy = load_f32(DY + row64 * stride_dy, cols, mask)
                xhat = tl.where(mask, (load_f32(X + row64 * stride_x, cols, mask) - mean) * rstd, 0.0)
                dx = (load_f32(W, cols, mask) * dy - c2 - xhat * c1) * rstd
                tl.store(DX + row64 * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
                tl.store(dw_row + cols, load_f32(dw_row, cols, mask) + dy * xhat, mask=mask)
                tl.store(db_row + cols, load_f32(db_row, cols, mask) + dy, mask=mask)


class LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps: float, block_size: int | None) -> torch.Tensor:
        x2, y, block, (mean, rstd) = forward_buffers(x, block_size, num_stats=2)
        m, n = x2.shape
        w = weight.contiguous()
        b = bias.contiguous() if bias is not None else w  # placeholder pointer, never read
        if m > 0:
            _layer_norm_fwd[(m,)](
                x2, w, b, y, mean, rstd, x2.stride(0), y.stride(0), n, eps,
                BLOCK_N=block, SINGLE_BLOCK=block >= n, HAS_BIAS=bias is not None, num_warps=num_warps_for(block),
            )
        ctx.save_for_backward(x2, w, mean, rstd)
        ctx.block = block
        ctx.x_shape = x.shape
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, w, mean, rstd = ctx.saved_tensors
        m, n = x2.shape
        dy2, dx, programs, (dw_partial, db_partial) = backward_buffers(x2, dy, num_partials=2)
        if m > 0:
            _layer_norm_bwd[(programs,)](
                dy2, x2, w, mean, rstd, dx, dw_partial, db_partial, dy2.stride(0), x2.stride(0), dx.stride(0),
                m, n, triton.cdiv(m, programs), BLOCK_N=ctx.block, SINGLE_BLOCK=ctx.block >= n,
                num_warps=num_warps_for(ctx.block),
            )
        dw = dw_partial.sum(0).to(w.dtype)
        db = None if ctx.bias_dtype is None else db_partial.sum(0).to(ctx.bias_dtype)
        return dx.view(ctx.x_shape), dw, db, None, None


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float = 1e-5, *, block_size: int | None = None
) -> torch.Tensor:
    """Triton LayerNorm (differentiable in x, weight and bias); see the module docstring."""
    check_norm_args("layer_norm", x, weight, bias)
    return LayerNormFunction.apply(x, weight, bias, eps, block_size)
