"""Blockwise attention of local queries against one set of keys/values (no communication).

The variants (``ring``, ``allgather``) call these once per key/value share they hold.
Public tensors are ``[b, s, h, d]``; compute works on ``[b, h, s, d]`` transposed views,
and the fp32 accumulators are allocated in ``[b, s, h, d]`` storage so that the final
output and gradients come back contiguous in the public layout without a copy.

Forward: for every planned block, ``(out, lse)`` of the block is merged into the
accumulators through the log-sum-exp (``merge_partial``). Backward: each block adds its
exact gradient (from the final out/lse) into fp32 ``dq`` and into this kv share's fp32
``dk``/``dv``.
"""

from __future__ import annotations

from typing import Callable

import torch

from kernels.attention_math import compute_dtype
from parallel3d.context_parallel.block_compute import BlockAttention, merge_partial
from parallel3d.context_parallel.blocks import BlockPlan, plan_blocks
from parallel3d.context_parallel.segments import Segment


def heads_first(x: torch.Tensor) -> torch.Tensor:
    """``[b, s, h, d] -> [b, h, s, d]`` view."""
    return x.transpose(-3, -2)


def zeros_like_public(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Zeros shaped like ``x [b, s, h, d]`` (contiguous) returned as the ``[b, h, s, d]`` view."""
    return heads_first(torch.zeros(x.shape, dtype=dtype or x.dtype, device=x.device))


def output_accumulators(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [b, hq, sq, d], lse [b, hq, sq])`` at 0 / -inf in the compute dtype, for ``q [b, s, hq, d]``."""
    ct = compute_dtype(q.dtype)
    b, s, h, _ = q.shape
    return zeros_like_public(q, ct), torch.full((b, h, s), float("-inf"), dtype=ct, device=q.device)


def finish_output(acc_out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The ``[b, s, h, d]`` output (contiguous) from the ``[b, h, s, d]`` accumulator view."""
    return heads_first(acc_out.to(dtype))


def plan_shares(engine: BlockAttention, q_segments: list[Segment], kv_segments: list[list[Segment]]) -> list[BlockPlan]:
    """One plan per K/V share (``kv_segments[j]``: where share ``j``'s keys sit), skips recorded."""
    plans = [plan_blocks(q_segments, segments, engine.document_ids) for segments in kv_segments]
    if engine.stats is not None:
        for plan in plans:
            engine.stats.record_skipped(plan.skipped)
    return plans


def attend(
    engine: BlockAttention, qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, plan: BlockPlan,
    acc_out: torch.Tensor, acc_lse: torch.Tensor, merged: set[tuple[int, int]] | None = None,
    between_blocks: Callable[[], object] | None = None,
) -> None:
    """Merge every block of ``plan`` (queries ``qh``, keys/values ``kh``/``vh``, all ``[b, h, s, d]``);
    ``between_blocks`` (optional) runs after each block (the ring's scheduling point, ``ring.py``).

    ``merged``: the query rows ``(offset, length)`` already holding a partial result, kept by the
    caller across calls on the same accumulators. The first block of rows is copied in, not
    merged: merging into 0 / -inf gives exactly that block's ``(out, lse)`` (``logaddexp(-inf, x)
    = x``, ``0 + out * exp(0) = out``), so the copy is the same result in one pass instead of ~8."""
    for block in plan.blocks:
        out, lse = engine.forward(qh[:, :, block.q_rows], kh[:, :, block.k_rows], vh[:, :, block.k_rows], block)
        rows = (block.q_offset, block.q.length)
        if merged is not None and rows not in merged:
            acc_out[:, :, block.q_rows].copy_(out)
            acc_lse[:, :, block.q_rows].copy_(lse)
            merged.add(rows)
        else:
            merge_partial(acc_out[:, :, block.q_rows], acc_lse[:, :, block.q_rows], out, lse)
        if between_blocks is not None:
            between_blocks()


def attend_backward(
    engine: BlockAttention, doh: torch.Tensor, qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor,
    outh: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, plan: BlockPlan,
    dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, between_blocks: Callable[[], object] | None = None,
) -> None:
    """Add every block's gradient into ``dq`` (queries) and ``dk``/``dv`` (this kv share), in place;
    ``between_blocks`` (optional) runs after each block."""
    for block in plan.blocks:
        q_rows, k_rows = block.q_rows, block.k_rows
        gq, gk, gv = engine.backward(
            doh[:, :, q_rows], qh[:, :, q_rows], kh[:, :, k_rows], vh[:, :, k_rows],
            outh[:, :, q_rows], lse[:, :, q_rows], delta[:, :, q_rows], block,
        )
        dq[:, :, q_rows] += gq
        dk[:, :, k_rows] += gk
        dv[:, :, k_rows] += gv
        if between_blocks is not None:
            between_blocks()


def backward_inputs(
    q: torch.Tensor, out: torch.Tensor, dout: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(qh, outh, doh, delta, dq)`` from ``[b, s, h, d]`` tensors: heads-first views,
    ``delta = rowsum(dout * out)`` ``[b, h, s]`` and a zero dq accumulator, in the compute dtype."""
    ct = compute_dtype(q.dtype)
    delta = (dout.to(ct) * out.to(ct)).sum(-1).transpose(1, 2)
    return heads_first(q), heads_first(out), heads_first(dout), delta, zeros_like_public(q, ct)
