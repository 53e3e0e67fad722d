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

from kernels.runtime import num_warps_for, reduction_programs, row_block


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Plain torch RMSNorm with fp32 statistics (the CPU path and the test oracle)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


@triton.jit
def _rms_norm_fwd(X, W, Y, RSTD, stride_x, stride_y, N, eps, BLOCK_N: tl.constexpr, SINGLE_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    y_row = Y + row * stride_y
    if SINGLE_BLOCK:
        cols = tl.arange(0, BLOCK_N)
        mask = cols < N
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_row + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)
    else:
        sq = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            x = tl.load(x_row + cols, mask=cols < N, other=0.0).to(tl.float32)
            sq += x * x
        rstd = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / N + eps)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = cols < N
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_row + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _rms_norm_bwd(
    DY, X, W, RSTD, DX, DW_PARTIAL, stride_dy, stride_x, stride_dx, M, N, rows_per_program,
    BLOCK_N: tl.constexpr, SINGLE_BLOCK: tl.constexpr,
):
    # dx = rstd * (w*dy - xhat * mean(xhat * w*dy)),  dw = sum_rows dy * xhat
    pid = tl.program_id(0)
    row_start = pid * rows_per_program
    n_rows = tl.minimum(row_start + rows_per_program, M) - row_start
    first_row = row_start.to(tl.int64)
    dw_row = DW_PARTIAL + pid.to(tl.int64) * N
    if SINGLE_BLOCK:
        cols = tl.arange(0, BLOCK_N)
        mask = cols < N
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK_N], dtype=tl.float32)
        for i in range(0, n_rows):
            row64 = first_row + i
            x = tl.load(X + row64 * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + row64 * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + row64)
            xhat = x * rstd
            wdy = w * dy
            c = tl.sum(xhat * wdy, axis=0) / N
            dx = (wdy - xhat * c) * rstd
            tl.store(DX + row64 * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
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
                x = tl.load(X + row64 * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(DY + row64 * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
                w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
                acc += x * rstd * w * dy
            c = tl.sum(acc, axis=0) / N
            for start in range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                mask = cols < N
                x = tl.load(X + row64 * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(DY + row64 * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
                w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
                xhat = x * rstd
                dx = (w * dy - xhat * c) * rstd
                tl.store(DX + row64 * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
                dw = tl.load(dw_row + cols, mask=mask, other=0.0)
                tl.store(dw_row + cols, dw + dy * xhat, mask=mask)


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a 2-D ``[rows, N]`` view whose last dim is contiguous (copying only if needed)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def check_norm_args(name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"{name}: x must have a non-empty last dim, got shape {tuple(x.shape)}")
    for key, t in (("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != (x.shape[-1],):
            raise ValueError(f"{name}: {key} shape {tuple(t.shape)} must be ({x.shape[-1]},) = x.shape[-1:]")
        if t is not None and t.device != x.device:
            raise ValueError(f"{name}: {key} is on {t.device} but x is on {x.device}")


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, block_size: int | None) -> torch.Tensor:
        x2 = as_rows(x)
        m, n = x2.shape
        block = row_block(n, block_size)
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        rstd = torch.empty(m, dtype=torch.float32, device=x.device)
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
        dy2 = as_rows(dy)
        dx = torch.empty_like(x2, memory_format=torch.contiguous_format)
        programs = reduction_programs(m, x2.device)
        dw_partial = torch.zeros((programs, n), dtype=torch.float32, device=x2.device)
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
