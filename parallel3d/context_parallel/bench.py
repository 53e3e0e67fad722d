"""Micro-benchmarks of context-parallel attention (called on every rank of a cp group).

- ``bench_variants``: median forward + backward time of one attention layer per
  ``cp_comm`` variant, on this rank's share of a ``[batch, seq_len]`` sequence.
- ``bench_ring_overlap``: how much of the ring's K/V traffic hides behind compute, from
  three timings of the ring forward: communication alone (the ``cp - 1`` exchanges with no
  compute), compute alone (the same blocks against local K/V, no exchange) and the real,
  overlapped ring. ``hidden = (comm + compute - overlapped) / comm``, clipped to [0, 1].

Times are the slowest rank's (max over the group) median of ``steps`` repetitions after
``warmup``, each repetition started together (a barrier). The caller owns process groups
and prints or stores the dicts (``scripts/bench_cp.py``).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

from kernels.attention_math import default_scale
from parallel3d.context_parallel.attention import context_parallel_attention
from parallel3d.context_parallel.block_compute import BlockAttention, resolve_attention_backend
from parallel3d.context_parallel.blockwise import attend, heads_first, output_accumulators, plan_shares
from parallel3d.context_parallel.group_comm import CPGroup
from parallel3d.context_parallel.load_balance import rank_segments
from parallel3d.context_parallel.ring import RingAttention


def _slowest_median_ms(fn: Callable[[], None], group: CPGroup, steps: int, warmup: int) -> float:
    times = []
    for i in range(warmup + steps):
        if group.size > 1:
            dist.barrier(group=group.group)
        start = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    median = torch.tensor([statistics.median(times) * 1e3], dtype=torch.float64)
    if group.size > 1:
        dist.all_reduce(median, op=dist.ReduceOp.MAX, group=group.group)
    return float(median)


def _share(cp_group: CPGroup, batch: int, seq_len: int, heads: int, head_dim: int, dtype: torch.dtype,
           seed: int, grad: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + cp_group.index)
    x = torch.randn(batch, seq_len // cp_group.size, heads, head_dim, generator=g).to(dtype)
    return x.requires_grad_(grad)


def bench_variants(
    cp_group: CPGroup, *, batch: int, seq_len: int, q_heads: int, kv_heads: int, head_dim: int,
    variants: dict[str, dict], dtype: torch.dtype = torch.float32, backend: str = "auto",
    steps: int = 5, warmup: int = 1, document_ids: torch.Tensor | None = None,
) -> dict[str, float]:
    """``{label: ms}`` per forward + backward step; ``variants`` maps a label to the keyword
    arguments of ``context_parallel_attention`` (``cp_comm`` and, for a2a+p2p, its sub-groups)."""
    q = _share(cp_group, batch, seq_len, q_heads, head_dim, dtype, 1, True)
    k = _share(cp_group, batch, seq_len, kv_heads, head_dim, dtype, 2, True)
    v = _share(cp_group, batch, seq_len, kv_heads, head_dim, dtype, 3, True)
    dout = torch.randn_like(q)
    results = {}
    for label, kwargs in variants.items():
        def step() -> None:
            out = context_parallel_attention(q, k, v, cp_group=cp_group, document_ids=document_ids,
                                             backend=backend, **kwargs)
            torch.autograd.grad(out, (q, k, v), dout)

        results[label] = _slowest_median_ms(step, cp_group, steps, warmup)
    return results


def bench_ring_overlap(
    cp_group: CPGroup, *, batch: int, seq_len: int, q_heads: int, kv_heads: int, head_dim: int,
    dtype: torch.dtype = torch.float32, backend: str = "auto", steps: int = 5, warmup: int = 1,
) -> dict[str, float]:
    """``comm_ms``, ``compute_ms``, ``overlapped_ms`` and ``hidden`` of the ring forward."""
    n = cp_group.size
    q = _share(cp_group, batch, seq_len, q_heads, head_dim, dtype, 1, False)
    k = _share(cp_group, batch, seq_len, kv_heads, head_dim, dtype, 2, False)
    v = _share(cp_group, batch, seq_len, kv_heads, head_dim, dtype, 3, False)
    engine = BlockAttention(resolve_attention_backend(backend, q), default_scale(head_dim))
    members = [rank_segments(seq_len, n, j) for j in range(n)]
    plans = plan_shares(engine, members[cp_group.index], members)

    def comm_only() -> None:
        kv = [k, v]
        for t in range(n - 1):
            receive = [torch.empty_like(k), torch.empty_like(v)]
            cp_group.ring_exchange(kv, receive).wait()
            kv = receive

    def compute_only() -> None:
        acc_out, acc_lse = output_accumulators(q)
        for t in range(n):  # the blocks of every step, against local K/V of the same shape
            attend(engine, heads_first(q), heads_first(k), heads_first(v), plans[(cp_group.index - t) % n],
                   acc_out, acc_lse)

    def overlapped() -> None:
        RingAttention.apply(q, k, v, cp_group, members[cp_group.index], members, engine)

    comm = _slowest_median_ms(comm_only, cp_group, steps, warmup) if n > 1 else 0.0
    compute = _slowest_median_ms(compute_only, cp_group, steps, warmup)
    both = _slowest_median_ms(overlapped, cp_group, steps, warmup)
    hidden = min(1.0, max(0.0, (comm + compute - both) / comm)) if comm > 0 else 0.0
    return {"comm_ms": comm, "compute_ms": compute, "overlapped_ms": both, "hidden": hidden}
