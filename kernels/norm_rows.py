"""What RMSNorm and LayerNorm share: row views, argument checks, buffers and row loads.

Both normalise each row of ``x [..., N]`` seen as ``[M, N]`` (last dim contiguous), keep
fp32 per-row statistics, and reduce weight (and bias) gradients in two deterministic
stages: each backward program sums its contiguous block of rows into one fp32 row of a
``[programs, N]`` partial buffer, then the host sums those rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.runtime import reduction_programs, row_block


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


def forward_buffers(
    x: torch.Tensor, block_size: int | None, num_stats: int
) -> tuple[torch.Tensor, torch.Tensor, int, list[torch.Tensor]]:
    """``(x2 [M, N], y [M, N] in x's dtype, block, num_stats fp32 [M] statistics buffers)``."""
    x2 = as_rows(x)
    m, n = x2.shape
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    stats = [torch.empty(m, dtype=torch.float32, device=x.device) for _ in range(num_stats)]
    return x2, y, row_block(n, block_size), stats


def backward_buffers(
    x2: torch.Tensor, dy: torch.Tensor, num_partials: int
) -> tuple[torch.Tensor, torch.Tensor, int, list[torch.Tensor]]:
    """``(dy2 [M, N], dx like x2, programs, num_partials zeroed fp32 [programs, N] buffers)``."""
    m, n = x2.shape
    dx = torch.empty_like(x2, memory_format=torch.contiguous_format)
    programs = reduction_programs(m, x2.device)
    partials = [torch.zeros((programs, n), dtype=torch.float32, device=x2.device) for _ in range(num_partials)]
    return as_rows(dy), dx, programs, partials


@triton.jit
def program_rows(rows_per_program, M):
    """This backward program's block of rows: (first row as int64, number of rows)."""
    row_start = tl.program_id(0) * rows_per_program
    n_rows = tl.minimum(row_start + rows_per_program, M) - row_start
    return row_start.to(tl.int64), n_rows


@triton.jit
def load_f32(ROW, cols, mask):
    """Columns ``cols`` of the row starting at ``ROW`` as fp32 (0 where masked)."""
    return tl.load(ROW + cols, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def forward_row(X, Y, stride_x, stride_y):
    """This forward program's row: (row index as int64, start of its x row, start of its y row)."""
    row = tl.program_id(0).to(tl.int64)
    return row, X + row * stride_x, Y + row * stride_y
