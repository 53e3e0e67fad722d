"""LayerNorm over the last dim: ``y = (x - mean) * rstd * weight + bias``.

Shapes: ``x [..., N]`` (fp32, bf16 or fp16), ``weight [N]``, ``bias [N]`` or None; ``y`` has
x's shape and dtype. Mean and rstd are fp32 (one each per row) and are saved for backward
with ``x``. Backward: ``dx`` per row; ``dw`` and ``db`` are reduced over rows in two
deterministic stages (per-program fp32 partial rows, then a host sum), as in rmsnorm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.rmsnorm import as_rows, check_norm_args
from kernels.runtime import num_warps_for, reduction_programs, row_block


def layer_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float = 1e-5
) -> torch.Tensor:
    """torch's own LayerNorm (fp32 statistics on every device)."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


@triton.jit
def _layer_norm_fwd(
    X, W, B, Y, MEAN, RSTD, stride_x, stride_y, N, eps,
    BLOCK_N: tl.constexpr, SINGLE_BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    y_row = Y + row * stride_y
    if SINGLE_BLOCK:
        cols = tl.arange(0, BLOCK_N)
        mask = cols < N
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=0) / N
        xc = tl.where(mask, x - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / N + eps)
        y = xc * rstd * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_row + cols, y.to(Y.dtype.element_ty), mask=mask)
    else:
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            total += tl.load(x_row + cols, mask=cols < N, other=0.0).to(tl.float32)
        mean = tl.sum(total, axis=0) / N
        # Second pass over centred values: the one-pass E[x^2] - mean^2 loses digits.
        sq = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = cols < N
            xc = tl.where(mask, tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32) - mean, 0.0)
            sq += xc * xc
        rstd = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / N + eps)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = cols < N
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            y = (x - mean) * rstd * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_BIAS:
                y += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_row + cols, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)


@triton.jit
def _layer_norm_bwd(
    DY, X, W, MEAN, RSTD, DX, DW_PARTIAL, DB_PARTIAL, stride_dy, stride_x, stride_dx, M, N, rows_per_program,
    BLOCK_N: tl.constexpr, SINGLE_BLOCK: tl.constexpr,
):
    # dx = rstd * (w*dy - mean(w*dy) - xhat * mean(xhat * w*dy)); dw = sum dy*xhat; db = sum dy
    pid = tl.program_id(0)
    row_start = pid * rows_per_program
    n_rows = tl.minimum(row_start + rows_per_program, M) - row_start
    first_row = row_start.to(tl.int64)
    dw_row = DW_PARTIAL + pid.to(tl.int64) * N
    db_row = DB_PARTIAL + pid.to(tl.int64) * N
    if SINGLE_BLOCK:
        cols = tl.arange(0, BLOCK_N)
        mask = cols < N
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK_N], dtype=tl.float32)
        db = tl.zeros([BLOCK_N], dtype=tl.float32)
        for i in range(0, n_rows):
            row64 = first_row + i
            x = tl.load(X + row64 * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + row64 * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
            xhat = tl.where(mask, (x - tl.load(MEAN + row64)) * tl.load(RSTD + row64), 0.0)
            wdy = w * dy
            c1 = tl.sum(xhat * wdy, axis=0) / N
            c2 = tl.sum(wdy, axis=0) / N
            dx = (wdy - c2 - xhat * c1) * tl.load(RSTD + row64)
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
                x = tl.load(X + row64 * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(DY + row64 * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
                wdy = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32) * dy
                acc1 += tl.where(mask, (x - mean) * rstd, 0.0) * wdy
                acc2 += wdy
            c1 = tl.sum(acc1, axis=0) / N
            c2 = tl.sum(acc2, axis=0) / N
            for start in range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                mask = cols < N
                x = tl.load(X + row64 * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(DY + row64 * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
                w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
                xhat = tl.where(mask, (x - mean) * rstd, 0.0)
                dx = (w * dy - c2 - xhat * c1) * rstd
                tl.store(DX + row64 * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
                tl.store(dw_row + cols, tl.load(dw_row + cols, mask=mask, other=0.0) + dy * xhat, mask=mask)
                tl.store(db_row + cols, tl.load(db_row + cols, mask=mask, other=0.0) + dy, mask=mask)


class LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps: float, block_size: int | None) -> torch.Tensor:
        x2 = as_rows(x)
        m, n = x2.shape
        block = row_block(n, block_size)
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        mean = torch.empty(m, dtype=torch.float32, device=x.device)
        rstd = torch.empty(m, dtype=torch.float32, device=x.device)
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
        dy2 = as_rows(dy)
        dx = torch.empty_like(x2, memory_format=torch.contiguous_format)
        programs = reduction_programs(m, x2.device)
        dw_partial = torch.zeros((programs, n), dtype=torch.float32, device=x2.device)
        db_partial = torch.zeros((programs, n), dtype=torch.float32, device=x2.device)
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
