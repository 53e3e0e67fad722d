"""Ring attention (``cp_comm=p2p``): K/V shares travel around the ring group.

Inputs ``q [b, s_q, hq, d]``, ``k``/``v [b, s_kv, hk, d]`` are this rank's share; ring
member ``j`` holds keys/values at the global segments ``kv_segments[j]`` (all members'
shares are the same length), the local queries sit at ``q_segments``. Output
``[b, s_q, hq, d]``: attention of the local queries over *every* member's keys.

Forward, step ``t = 0 .. n-1``: this rank holds the K/V of member ``(i - t) mod n``. It
first posts the exchange that passes that K/V on (send to ``i+1``, receive from ``i-1``),
then computes its blocks against it, then waits: the transfer hides behind the compute.
Only this rank's own K/V (the inputs), the output and the fp32 log-sum-exp are saved for
backward; received K/V are dropped after their step.

Backward replays the ring: K/V travel again (posted before each step's compute), and the
partial ``dK``/``dV`` of the share a rank just used travel *with* the share: a rank adds
its contribution to the partial it received and passes it on; after ``n`` steps the last
hop delivers each share's complete ``dK``/``dV`` to its owner. The partials travel in fp32
and the partial arriving from the previous rank is added after this step's compute, so
its transfer overlaps the compute too. With ``n = 1`` there is no communication: this is
also the local (cp = 1, or after an all-to-all) attention.

On CPU, while an exchange is in flight, the compute yields the core after every block
(``_scheduling_point``). Why: gloo moves the bytes on its own thread, which needs a core
several times per transfer (rendezvous, then socket-buffer-sized pieces on both sides). With
more busy ranks than cores, a compute thread that never enters the kernel keeps its core
until the scheduler's tick, so each of those wake-ups waits for one and the transfer spills
past the compute. Measured on 2 cores, 4 ranks, seq 2048 (``scripts/bench_cp.py
--overlap-only``, paired with the ring without it): blocked 0.04-2.6 ms instead of 3.1-5.5 ms
of a 4.7-7.6 ms transfer, the forward's wall 0.96-1.00x (the cores were busy either way).
The yield is one system call per block; it changes no number.

Blocks are planned once per call (``blocks.plan_blocks``) and reused in backward; blocks
the causal or document mask hides entirely are never computed, in either direction.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from kernels.attention_math import compute_dtype
from parallel3d.context_parallel.block_compute import BlockAttention
from parallel3d.context_parallel.blockwise import (
    attend, attend_backward, backward_inputs, finish_output, heads_first, output_accumulators, plan_shares,
)
from parallel3d.context_parallel.group_comm import CPGroup
from parallel3d.context_parallel.segments import Segment


def _receive_buffers(kv: list[torch.Tensor], n: int) -> list[list[torch.Tensor]]:
    """Two K/V receive buffers used alternately (one for n = 2): step t receives into buffer t % 2
    while computing on the other, whose send has completed. The inputs themselves (``kv`` may
    *be* k and v) are never a receive target."""
    return [[torch.empty_like(t) for t in kv] for _ in range(min(n - 1, 2))]


def _scheduling_point(like: torch.Tensor, in_flight: bool) -> Callable[[], object] | None:
    """``os.sched_yield`` between blocks while an exchange is in flight on CPU (see the module doc)."""
    return os.sched_yield if in_flight and like.device.type == "cpu" else None


class RingAttention(torch.autograd.Function):
    """``RingAttention.apply(q, k, v, ring, q_segments, kv_segments, engine)``; see the module doc."""

    @staticmethod
    def forward(ctx, q, k, v, ring: CPGroup, q_segments: list[Segment], kv_segments: list[list[Segment]],
                engine: BlockAttention):
        n, me = ring.size, ring.index
        if len(kv_segments) != n:
            raise ValueError(f"ring attention: {len(kv_segments)} kv segment lists for a ring of {n} ranks")
        by_member = plan_shares(engine, q_segments, kv_segments)
        plans = [by_member[(me - t) % n] for t in range(n)]  # step t holds member (me - t)'s K/V
        qh = heads_first(q)
        acc_out, acc_lse = output_accumulators(q)
        kv = [k.contiguous(), v.contiguous()] if n > 1 else [k, v]  # only sends need contiguous buffers
        receive = _receive_buffers(kv, n)
        merged: set[tuple[int, int]] = set()
        for t in range(n):
            pending = ring.ring_exchange(kv, receive[t % 2]) if t < n - 1 else None
            attend(engine, qh, heads_first(kv[0]), heads_first(kv[1]), plans[t], acc_out, acc_lse, merged,
                   _scheduling_point(q, pending is not None))
            if pending is not None:
                pending.wait()
                kv = receive[t % 2]
        out = finish_output(acc_out, q.dtype)
        ctx.save_for_backward(q, k, v, out, acc_lse)
        ctx.ring, ctx.plans, ctx.engine = ring, plans, engine
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, plans, engine = ctx.ring, ctx.plans, ctx.engine
        n = ring.size
        ct = compute_dtype(q.dtype)
        qh, outh, doh, delta, dq = backward_inputs(q, out, dout)
        kv = [k.contiguous(), v.contiguous()] if n > 1 else [k, v]  # only sends need contiguous buffers
        receive = _receive_buffers(kv, n)
        # Two sets of fp32 partial-gradient buffers: one being sent while the next fills.
        dkv_bufs = [[torch.zeros(k.shape, dtype=ct, device=k.device), torch.zeros(v.shape, dtype=ct, device=v.device)]
                    for _ in range(2 if n > 1 else 1)]
        incoming = [torch.empty_like(t) for t in dkv_bufs[0]] if n > 1 else []
        dkv_pending = None
        for t in range(n):
            kv_pending = ring.ring_exchange(kv, receive[t % 2]) if t < n - 1 else None
            dkv = dkv_bufs[t % len(dkv_bufs)]
            if t >= len(dkv_bufs):  # reused: its last send completed (waited at step t - 1)
                for buf in dkv:
                    buf.zero_()
            attend_backward(engine, doh, qh, heads_first(kv[0]), heads_first(kv[1]), outh, lse, delta, plans[t],
                            dq, heads_first(dkv[0]), heads_first(dkv[1]),
                            _scheduling_point(q, kv_pending is not None or dkv_pending is not None))
            if dkv_pending is not None:
                dkv_pending.wait()  # the partials of this share from the ranks before us
                for buf, arrived in zip(dkv, incoming):
                    buf += arrived
            if n > 1:
                # Pass this share's partials on; at t = n-1 the next rank is the share's owner.
                incoming = [torch.empty_like(b) for b in dkv]
                dkv_pending = ring.ring_exchange(dkv, incoming)
            if kv_pending is not None:
                kv_pending.wait()
                kv = receive[t % 2]
        if dkv_pending is not None:
            dkv_pending.wait()
            dk, dv = incoming
        else:
            dk, dv = dkv_bufs[0]
        return dq.transpose(1, 2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None
