"""Ulysses all-to-all (``cp_comm=a2a``): sequence-sharded <-> head-sharded, over one group.

Before attention each of the group's ``n`` members holds all heads of its sequence share
``[b, s_local, H, d]``; one all-to-all leaves it every member's share of ``H / n`` heads,
``[b, n * s_local, H / n, d]`` (member-major along the sequence: member 0's share first).
Member ``j`` gets heads ``[j H / n, (j + 1) H / n)``. After attention the inverse
all-to-all restores the sequence shard (``Redistribute``, whose backward is the other
direction).

Grouped-query attention: query head ``i`` reads kv head ``i // (hq / hk)``, so member
``j``'s query heads read kv heads ``[j hk / n, (j + 1) hk / n)`` when ``n`` divides
``hk``. When ``n`` exceeds ``hk`` (and is a multiple of it) each kv head is repeated
``n / hk`` times before the all-to-all: member ``j`` then gets the one kv head its query
heads read, and the repeat's backward sums the copies' gradients. Anything else cannot
be split and raises ``HeadSplitError`` naming the counts.
"""

from __future__ import annotations

import torch

from parallel3d.context_parallel.group_comm import CPGroup


class HeadSplitError(ValueError):
    """The attention heads of this rank cannot be split over the all-to-all group."""


def kv_repeats(q_heads: int, kv_heads: int, a2a_size: int) -> int:
    """How many times each kv head is repeated so that ``a2a_size`` members get whole heads."""
    if q_heads % kv_heads:
        raise HeadSplitError(f"{q_heads} query heads do not group over {kv_heads} kv heads")
    if q_heads % a2a_size:
        raise HeadSplitError(
            f"cp all-to-all over {a2a_size} ranks: {q_heads} query heads (per tensor-parallel rank) "
            f"are not divisible by {a2a_size}"
        )
    if kv_heads % a2a_size == 0:
        return 1
    if a2a_size % kv_heads == 0:
        return a2a_size // kv_heads
    raise HeadSplitError(
        f"cp all-to-all over {a2a_size} ranks: {kv_heads} kv heads (per tensor-parallel rank) can be neither "
        f"split over {a2a_size} ranks nor replicated to {a2a_size} (it must divide or be a multiple of {a2a_size})"
    )


def _seq_to_heads(x: torch.Tensor, group: CPGroup) -> torch.Tensor:
    n = group.size
    b, s, h, d = x.shape
    send = x.reshape(b, s, n, h // n, d).permute(2, 0, 1, 3, 4).contiguous()  # [dest, b, s, h/n, d]
    recv = torch.empty_like(send)  # [source, b, s, h/n, d]
    group.all_to_all(recv, send)
    return recv.permute(1, 0, 2, 3, 4).reshape(b, n * s, h // n, d)


def _heads_to_seq(y: torch.Tensor, group: CPGroup) -> torch.Tensor:
    n = group.size
    b, s_all, h, d = y.shape
    send = y.reshape(b, n, s_all // n, h, d).transpose(0, 1).contiguous()  # [dest (seq owner), b, s, h, d]
    recv = torch.empty_like(send)  # [source (head owner), b, s, h, d]
    group.all_to_all(recv, send)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s_all // n, n * h, d)


class Redistribute(torch.autograd.Function):
    """``to_heads=True``: ``[b, s_local, H, d]`` (sequence share, all heads) -> ``[b, n s_local, H / n, d]``
    (every share, this member's heads); ``False``: the inverse. The backward is the other direction."""

    @staticmethod
    def forward(ctx, x, group: CPGroup, to_heads: bool):
        ctx.group, ctx.to_heads = group, to_heads
        return _seq_to_heads(x, group) if to_heads else _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return (_heads_to_seq(grad, ctx.group) if ctx.to_heads else _seq_to_heads(grad, ctx.group)), None, None


def scatter_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: CPGroup
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v from sequence shards to head shards in ONE all-to-all (kv heads repeated as needed)."""
    n = group.size
    if n == 1:
        return q, k, v
    repeats = kv_repeats(q.shape[2], k.shape[2], n)
    if repeats > 1:
        k, v = k.repeat_interleave(repeats, dim=2), v.repeat_interleave(repeats, dim=2)
    b, s, _, d = q.shape
    per_dest = [t.reshape(b, s, n, t.shape[2] // n, d) for t in (q, k, v)]
    widths = [t.shape[3] for t in per_dest]
    packed = torch.cat(per_dest, dim=3).reshape(b, s, n * sum(widths), d)
    heads = Redistribute.apply(packed, group, True)
    q_h, k_h, v_h = heads.split(widths, dim=2)
    return q_h, k_h, v_h


def gather_heads(out: torch.Tensor, group: CPGroup) -> torch.Tensor:
    """The attention output back from head shards to this rank's sequence share."""
    return out if group.size == 1 else Redistribute.apply(out, group, False)
