"""Attention whose whole plan is ONE fused block: one kernel call forward, one backward.

After the all-to-all of ``cp_comm=a2a`` (or with cp = 1) a rank holds the whole sequence
for its heads, laid out by position (the reorder is folded into the all-to-all's copies).
Without a document mask the plan of such a call (``blocks.plan_blocks``) is a single causal
block covering every local query and key; when the engine runs it fused (torch's CPU flash
kernels, ``BlockAttention.fused``) the general blockwise path only adds work around that one
call: zero/-inf accumulators and a copy into them, ``delta = rowsum(dout * out)`` that the
kernel does not read, zero gradient buffers and ``+=`` into them. Here the kernel's out / lse
are the result and its dq / dk / dv are the gradients (grouped kv heads are read by the
kernel, not repeated).

Invariant: used only when ``single_fused_block`` returns a block, i.e. the result is
exactly the general path's for that one block (same kernel, same inputs); every other
plan (documents, several blocks, Triton, the math path) goes through ``ring.RingAttention``.
Public tensors are ``[b, s, h, d]``; the kernel gets heads-first views and its outputs,
laid out like its inputs, come back contiguous in the public layout without a copy.
"""

from __future__ import annotations

import torch

from parallel3d.context_parallel.block_compute import BlockAttention
from parallel3d.context_parallel.blocks import Block, plan_blocks
from parallel3d.context_parallel.blockwise import heads_first as _heads_first
from parallel3d.context_parallel.segments import Segment, total_length


def single_fused_block(engine: BlockAttention, q: torch.Tensor, q_segments: list[Segment],
                       kv_segments: list[Segment]) -> Block | None:
    """The one block of a plan that is a single fused block over all of ``q`` and the keys, else None.
    Skipped blocks of the plan are recorded in ``engine.stats`` only when the block is returned
    (otherwise the general path plans, and records, them itself)."""
    length = total_length(q_segments)
    if total_length(kv_segments) != length or q.shape[1] != length:
        return None
    plan = plan_blocks(q_segments, kv_segments, engine.document_ids)
    if len(plan.blocks) != 1:
        return None
    block = plan.blocks[0]
    whole = block.q_offset == block.k_offset == 0 and block.q.length == block.k.length == length
    if not (whole and engine.fused(block, q)):
        return None
    if engine.stats is not None:
        engine.stats.record_skipped(plan.skipped)
    return block


class SingleBlockAttention(torch.autograd.Function):
    """``SingleBlockAttention.apply(q, k, v, block, engine)``: ``q [b, s, hq, d]``, ``k``/``v [b, s, hk, d]``
    -> ``[b, s, hq, d]`` in q's dtype; ``block`` from ``single_fused_block``."""

    @staticmethod
    def forward(ctx, q, k, v, block: Block, engine: BlockAttention):
        out, lse = engine.fused_forward(_heads_first(q), _heads_first(k), _heads_first(v), block)
        out = _heads_first(out).contiguous()  # no copy: the kernel lays out out like q
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.block, ctx.engine = block, engine
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        grads = ctx.engine.fused_backward(*(_heads_first(t) for t in (dout, q, k, v, out)), lse, ctx.block)
        return (*(_heads_first(g).contiguous() for g in grads), None, None)
