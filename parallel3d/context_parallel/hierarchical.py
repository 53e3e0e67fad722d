"""All-to-all inside groups, ring across them: ``a2a+p2p``, and ``a2a`` / ``p2p`` as its ends.

The cp group's ``n`` ranks (cp-ranks ``0 .. n-1``, each holding its load-balanced share,
``load_balance.rank_segments``) are arranged as ``n / a`` all-to-all groups of ``a``
consecutive cp-ranks; the ring joins the members with the same index in every all-to-all
group (``hierarchical_rank_lists``). cp-rank ``p`` is member ``p % a`` of all-to-all
group ``p // a`` and member ``p // a`` of ring ``p % a``.

1. All-to-all inside the group (``ulysses.scatter_heads``): the rank now holds the
   sequence shares of its ``a`` group members, for ``1 / a`` of the heads.
2. Those ``2 a`` chunks are reordered by position (inside the all-to-all's own copies) into contiguous runs (one run for the
   whole sequence when ``a = n``; two when ``a = 1``) so that blocks are as large as
   possible; with document ids the runs are cut back to chunk length so that blocks a
   document boundary hides can still be skipped.
3. Ring attention (``ring.RingAttention``) across the ``n / a`` groups: member ``g`` of the
   ring holds group ``g``'s runs. A ring of one whose runs plan as one fused block (``a = n``
   or cp = 1, no document mask, torch's CPU flash kernels) is one kernel call each way
   instead (``single_block``).
4. The inverse reorder and all-to-all.

``a = 1`` is ``p2p`` (no all-to-all), ``a = n`` is ``a2a`` (a ring of one: no p2p).
"""

from __future__ import annotations

import torch

from parallel3d.context_parallel.block_compute import BlockAttention
from parallel3d.context_parallel.group_comm import CPGroup
from parallel3d.context_parallel.load_balance import check_divisible, rank_segments
from parallel3d.context_parallel.ring import RingAttention
from parallel3d.context_parallel.segments import Segment, coalesced_order, inverse_order, reorder, split_segments
from parallel3d.context_parallel.single_block import SingleBlockAttention, single_fused_block
from parallel3d.context_parallel.ulysses import gather_heads, scatter_heads


def hierarchical_rank_lists(cp_ranks: list[int], a2a_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """``(a2a_groups, ring_groups)`` of one cp group whose global ranks are ``cp_ranks`` (cp-rank order).

    All-to-all groups are runs of ``a2a_size`` consecutive cp-ranks (put them on one node:
    the all-to-all moves the most bytes); ring groups take one member of each. Every rank
    must create every one of these groups, in this order, with ``dist.new_group``."""
    n = len(cp_ranks)
    if a2a_size < 1 or n % a2a_size:
        raise ValueError(f"parallel.cp_a2a_size={a2a_size} must divide parallel.cp={n}")
    a2a_groups = [cp_ranks[g * a2a_size:(g + 1) * a2a_size] for g in range(n // a2a_size)]
    ring_groups = [cp_ranks[i::a2a_size] for i in range(a2a_size)]
    return a2a_groups, ring_groups


def _group_layout(seq_len: int, cp: int, a2a_size: int, group: int) -> list[Segment]:
    """Global segments of all-to-all group ``group`` after the all-to-all (member-major)."""
    return [seg for member in range(a2a_size) for seg in rank_segments(seq_len, cp, group * a2a_size + member)]


def ulysses_ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, a2a: CPGroup, ring: CPGroup, engine: BlockAttention,
) -> torch.Tensor:
    """Attention of this rank's share ``q [b, s_local, hq, d]``, ``k``/``v [b, s_local, hk, d]`` over the
    whole sequence; returns ``[b, s_local, hq, d]``. ``a2a``/``ring``: this rank's sub-groups."""
    a, groups = a2a.size, ring.size
    cp = a * groups
    seq_len = q.shape[1] * cp
    chunk = check_divisible(seq_len, cp)
    layouts = [_group_layout(seq_len, cp, a, g) for g in range(groups)]
    # Every group reorders its own tensors, so group g's K/V arrive laid out as runs[g].
    runs = [coalesced_order(layout)[1] for layout in layouts]
    if engine.document_ids is not None:
        runs = [split_segments(r, chunk) for r in runs]
    mine = layouts[ring.index]
    order = coalesced_order(mine)[0]
    if a == 1:
        q_h, k_h, v_h = (reorder(t, mine, order, seq_dim=1) for t in (q, k, v))
    else:  # the all-to-all's copies out of / into its buffers do the reorder (no extra pass)
        q_h, k_h, v_h = scatter_heads(q, k, v, a2a, order)
    block = single_fused_block(engine, q_h, runs[0], runs[0]) if groups == 1 else None
    if block is not None:
        out = SingleBlockAttention.apply(q_h, k_h, v_h, block, engine)
    else:
        out = RingAttention.apply(q_h, k_h, v_h, ring, runs[ring.index], runs, engine)
    if a == 1:
        return reorder(out, [mine[i] for i in order], inverse_order(order), seq_dim=1)
    return gather_heads(out, a2a, order)
