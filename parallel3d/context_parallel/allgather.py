"""All-gather attention (``cp_comm=allgather``): every rank gathers all K/V once per layer.

Inputs ``q [b, s_q, hq, d]``, ``k``/``v [b, s_kv, hk, d]`` are this rank's share; member
``j`` of the group holds keys/values at ``kv_segments[j]``, the local queries sit at
``q_segments``. Output ``[b, s_q, hq, d]``.

Forward: one all-gather of this rank's packed K/V (``[2, b, s_kv, hk, d]``) is posted, the
blocks against the rank's own K/V are computed while it runs, then the blocks against every
other member's. Backward gathers K/V again (the gathered copy is not kept between forward
and backward, so saved activations stay at this rank's share), overlapping the own-share
blocks, accumulates fp32 ``dK``/``dV`` for every member's share and reduce-scatters them:
each member receives the sum over ranks of the gradient of its own K/V (fp32 on the wire).
Blocks hidden by the causal or document mask are never computed.
"""

from __future__ import annotations

import torch

from kernels.attention_math import compute_dtype
from parallel3d.context_parallel.block_compute import BlockAttention
from parallel3d.context_parallel.blockwise import (
    attend, attend_backward, backward_inputs, finish_output, heads_first, output_accumulators, plan_shares,
)
from parallel3d.context_parallel.group_comm import CPGroup, release
from parallel3d.context_parallel.segments import Segment


def _post_gather(group: CPGroup, k: torch.Tensor, v: torch.Tensor):
    """``(gathered [n, 2, b, s, hk, d], handle, buffers)``: every member's packed K/V, async; ``buffers``
    (the packed send and the gathered output) are released once the shares are used (``group_comm.release``)."""
    packed = torch.stack([k, v])
    gathered = torch.empty((group.size * 2, *k.shape), dtype=packed.dtype, device=packed.device)
    pending = group.all_gather(gathered, packed, async_op=True)
    return gathered.view(group.size, *packed.shape), pending, (packed, gathered)


def _shares(group: CPGroup, k: torch.Tensor, v: torch.Tensor, gathered: torch.Tensor, pending):
    """``(member, k_j, v_j)`` for every member, this rank's own first: its K/V need no
    communication, so they are computed while the all-gather runs (waited on once)."""
    yield group.index, k, v
    pending.wait()
    for j in range(group.size):
        if j != group.index:
            yield j, gathered[j, 0], gathered[j, 1]


class AllGatherAttention(torch.autograd.Function):
    """``AllGatherAttention.apply(q, k, v, group, q_segments, kv_segments, engine)``; see the module doc."""

    @staticmethod
    def forward(ctx, q, k, v, group: CPGroup, q_segments: list[Segment], kv_segments: list[list[Segment]],
                engine: BlockAttention):
        if len(kv_segments) != group.size:
            raise ValueError(f"all-gather attention: {len(kv_segments)} kv segment lists for {group.size} ranks")
        plans = plan_shares(engine, q_segments, kv_segments)
        gathered, pending, buffers = _post_gather(group, k, v)
        qh = heads_first(q)
        acc_out, acc_lse = output_accumulators(q)
        merged: set[tuple[int, int]] = set()
        for j, kj, vj in _shares(group, k, v, gathered, pending):
            attend(engine, qh, heads_first(kj), heads_first(vj), plans[j], acc_out, acc_lse, merged)
        release(*buffers)  # freed here, not when gloo's worker drops the finished work (group_comm.release)
        out = finish_output(acc_out, q.dtype)
        ctx.save_for_backward(q, k, v, out, acc_lse)
        ctx.group, ctx.plans, ctx.engine = group, plans, engine
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, plans, engine = ctx.group, ctx.plans, ctx.engine
        ct = compute_dtype(q.dtype)
        gathered, pending, buffers = _post_gather(group, k, v)
        qh, outh, doh, delta, dq = backward_inputs(q, out, dout)
        dkv = torch.zeros((group.size * 2, *k.shape), dtype=ct, device=k.device)
        for j, kj, vj in _shares(group, k, v, gathered, pending):
            attend_backward(engine, doh, qh, heads_first(kj), heads_first(vj), outh, lse, delta, plans[j],
                            dq, heads_first(dkv[2 * j]), heads_first(dkv[2 * j + 1]))
        release(*buffers)
        mine = torch.empty((2, *k.shape), dtype=ct, device=k.device)  # dim 0 of dkv: member-major
        group.reduce_scatter(mine, dkv)
        release(dkv)
        return dq.transpose(1, 2).to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype), None, None, None, None
