"""Grouped GEMM for mixture-of-experts FFNs: many independent matmuls, one launch.

Rows ``x [M, K]`` are sorted by group (expert); group ``g`` owns rows
``[start_g, start_g + sizes[g])`` and the groups cover ``[0, M)`` exactly.

- ``grouped_mm(x, w, sizes)``: ``y[rows_g] = x[rows_g] @ w[g]`` with ``w [G, K, N]``
  (any strides, so a transposed view of ``[G, N, K]`` linear weights works) -> ``y [M, N]``.
- ``grouped_tmm(a, b, sizes)``: ``out[g] = a[rows_g]^T @ b[rows_g]`` -> ``[G, A, B]``, the
  weight gradient of the above (``a`` = upstream gradient or input rows).

Every output element is written: ``grouped_mm``'s tiles cover every row of every group, and
``grouped_tmm`` stores a (zero) accumulator for a group with no rows, so nothing is left
uninitialised for an expert that received no token. Tiles are listed on the host from
``sizes`` (which the MoE dispatcher already holds as host integers): program ``i`` of the
first grid axis computes ``BLOCK_M`` rows of one group, so no program straddles two groups.
Accumulation is fp32 (``input_precision="ieee"``: no TF32 for fp32 inputs); in the Triton
interpreter bf16 operands are upcast first (its bf16 ``tl.dot`` is wrong, see kernels.runtime).
The torch reference is the loop over groups in ``parallel3d.moe.grouped_gemm``.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from kernels.runtime import interpreter_active

DEFAULT_BLOCKS = (64, 64, 32)  # (BLOCK_M, BLOCK_N, BLOCK_K); tl.dot needs every block >= 16


@triton.jit
def _grouped_mm_kernel(X, W, Y, TILE_GROUP, TILE_ROW, GROUP_END, K, N,
                       sxm, sxk, swg, swk, swn, sym, syn,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       UPCAST: tl.constexpr):
    tile = tl.program_id(0)
    g = tl.load(TILE_GROUP + tile).to(tl.int64)
    row0 = tl.load(TILE_ROW + tile).to(tl.int64)
    row_end = tl.load(GROUP_END + g).to(tl.int64)
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < row_end
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(X + rows[:, None] * sxm + ks[None, :] * sxk, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(W + g * swg + ks[:, None] * swk + cols[None, :] * swn, mask=k_ok[:, None] & col_ok[None, :],
                    other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision="ieee")
    tl.store(Y + rows[:, None] * sym + cols[None, :] * syn, acc.to(Y.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _grouped_tmm_kernel(A, B, OUT, GROUP_START, GROUP_END, NA, NB,
                        sam, saa, sbm, sbb, sog, soa, sob,
                        BLOCK_M: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr,
                        UPCAST: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    start = tl.load(GROUP_START + g).to(tl.int64)
    end = tl.load(GROUP_END + g).to(tl.int64)
    ia = tl.program_id(1).to(tl.int64) * BLOCK_A + tl.arange(0, BLOCK_A)
    ib = tl.program_id(2).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    a_ok = ia < NA
    b_ok = ib < NB
    acc = tl.zeros((BLOCK_A, BLOCK_B), dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):  # no rows: the loop is empty and zeros are stored
        ms = m0 + tl.arange(0, BLOCK_M)
        m_ok = ms < end
        at = tl.load(A + ms[None, :] * sam + ia[:, None] * saa, mask=a_ok[:, None] & m_ok[None, :], other=0.0)
        b = tl.load(B + ms[:, None] * sbm + ib[None, :] * sbb, mask=m_ok[:, None] & b_ok[None, :], other=0.0)
        if UPCAST:
            at = at.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(at, b, acc, input_precision="ieee")
    tl.store(OUT + g * sog + ia[:, None] * soa + ib[None, :] * sob, acc.to(OUT.dtype.element_ty),
             mask=a_ok[:, None] & b_ok[None, :])


def _bounds(sizes: Sequence[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    size_t = torch.tensor(list(sizes), dtype=torch.int64)
    end = torch.cumsum(size_t, 0)
    return (end - size_t).to(device), end.to(device)


def _tiles(sizes: Sequence[int], block_m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(group of each tile, first row of each tile): ``ceil(size / block_m)`` tiles per group."""
    size_t = torch.tensor(list(sizes), dtype=torch.int64)
    per_group = (size_t + block_m - 1) // block_m
    group = torch.repeat_interleave(torch.arange(len(sizes)), per_group)
    first_tile = torch.cumsum(per_group, 0) - per_group
    start = torch.cumsum(size_t, 0) - size_t
    row = start[group] + (torch.arange(group.numel()) - first_tile[group]) * block_m
    return group.to(torch.int32).to(device), row.to(device)


def _check(sizes: Sequence[int], rows: int, what: str) -> None:
    if sum(sizes) != rows or any(s < 0 for s in sizes):
        raise ValueError(f"{what}: group sizes {list(sizes)} must be >= 0 and sum to the {rows} rows")


def grouped_mm(x: torch.Tensor, w: torch.Tensor, sizes: Sequence[int], *,
               blocks: tuple[int, int, int] | None = None) -> torch.Tensor:
    """``x [M, K]`` grouped by ``sizes`` times ``w [G, K, N]`` -> ``[M, N]`` in ``x``'s dtype."""
    _check(sizes, x.shape[0], "grouped_mm")
    if w.shape[0] != len(sizes) or w.shape[1] != x.shape[1]:
        raise ValueError(f"grouped_mm: w {tuple(w.shape)} does not match x {tuple(x.shape)} and {len(sizes)} groups")
    block_m, block_n, block_k = blocks or DEFAULT_BLOCKS
    m, k = x.shape
    n = w.shape[2]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_()
    tile_group, tile_row = _tiles(sizes, block_m, x.device)
    _, group_end = _bounds(sizes, x.device)
    grid = (tile_group.numel(), triton.cdiv(n, block_n))
    _grouped_mm_kernel[grid](x, w, y, tile_group, tile_row, group_end, k, n,
                             x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2), y.stride(0), y.stride(1),
                             BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                             UPCAST=interpreter_active(), num_warps=4)
    return y


def grouped_tmm(a: torch.Tensor, b: torch.Tensor, sizes: Sequence[int], *,
                blocks: tuple[int, int, int] | None = None) -> torch.Tensor:
    """``a [M, A]``, ``b [M, B]`` grouped by ``sizes`` -> ``[G, A, B]``, ``out[g] = a_g^T b_g`` (empty group: 0)."""
    _check(sizes, a.shape[0], "grouped_tmm")
    if b.shape[0] != a.shape[0]:
        raise ValueError(f"grouped_tmm: a {tuple(a.shape)} and b {tuple(b.shape)} need the same rows")
    block_m, block_a, block_b = blocks or DEFAULT_BLOCKS
    na, nb = a.shape[1], b.shape[1]
    out = torch.empty((len(sizes), na, nb), dtype=a.dtype, device=a.device)
    if out.numel() == 0:
        return out
    group_start, group_end = _bounds(sizes, a.device)
    grid = (len(sizes), triton.cdiv(na, block_a), triton.cdiv(nb, block_b))
    _grouped_tmm_kernel[grid](a, b, out, group_start, group_end, na, nb,
                              a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                              out.stride(0), out.stride(1), out.stride(2),
                              BLOCK_M=block_m, BLOCK_A=block_a, BLOCK_B=block_b,
                              UPCAST=interpreter_active(), num_warps=4)
    return out
