"""Ulysses all-to-all (``cp_comm=a2a``): sequence-sharded <-> head-sharded, over one group.

Before attention each of the group's ``n`` members holds all heads of its sequence share
``[b, s_local, H, d]``; one all-to-all leaves it every member's share of ``H / n`` heads,
``[b, n * s_local, H / n, d]`` (member-major along the sequence: member 0's share first).
Member ``j`` gets heads ``[j H / n, (j + 1) H / n)``. After attention the inverse
all-to-all restores the sequence shard (``HeadsToSeq``; each direction's backward is the other).

Cost: q, k and v travel in ONE all-to-all (their heads packed side by side in the send
buffer). With batch 1 (long-context training's micro-batch) every sequence piece is a
contiguous block on both sides, so the all-to-all runs as point-to-point pieces
(``CPGroup.all_to_all_pieces``) and each direction copies every element ONCE: towards heads,
q/k/v are packed into the send buffer and the pieces land straight in their places along
the sequence of the attention input (which is that receive buffer, viewed); back towards the
sequence, the pieces go out straight from the attention output (or gradient) and are copied
once from the receive buffers into the result. This member's own pieces skip the buffers.
The reorder by position (``order``: the load-balanced chunks, and the hierarchical variant's
runs) is where each piece is received or sent from, so it costs nothing. Larger batches use
one collective all-to-all and two copies per direction (into the send buffer, out of the
receive buffer, with the reorder folded into them). Buffers the op allocates for the exchange
alone are freed as soon as they are used (``group_comm.release``), whatever the backend still
references, so the step's peak memory does not depend on thread timing.

Grouped-query attention: query head ``i`` reads kv head ``i // (hq / hk)``, so member
``j``'s query heads read kv heads ``[j hk / n, (j + 1) hk / n)`` when ``n`` divides
``hk``. When ``n`` exceeds ``hk`` (and is a multiple of it) each kv head is repeated
``n / hk`` times before the all-to-all: member ``j`` then gets the one kv head its query
heads read, and the repeat's backward sums the copies' gradients. Anything else cannot
be split and raises ``HeadSplitError`` naming the counts.
"""

from __future__ import annotations

from typing import Sequence

import torch

from parallel3d.context_parallel.group_comm import CPGroup, release


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


def _pack_seq(tensors: Sequence[torch.Tensor], n: int) -> torch.Tensor:
    """Sequence shares ``[b, s, H_i, d]`` -> the send buffer ``[n (dest), b, s, sum H_i / n, d]``:
    member ``j``'s heads of every tensor side by side, written in one pass (no concatenated copy first)."""
    b, s, _, d = tensors[0].shape
    widths = [t.shape[2] // n for t in tensors]
    send = torch.empty((n, b, s, sum(widths), d), dtype=tensors[0].dtype, device=tensors[0].device)
    at = 0
    for t, w in zip(tensors, widths):
        send[:, :, :, at:at + w].copy_(t.reshape(b, s, n, w, d).permute(2, 0, 1, 3, 4))
        at += w
    return send


def _unpack_heads(recv: torch.Tensor, order: Sequence[int]) -> torch.Tensor:
    """``recv [n (source), b, s, W, d]`` -> ``[b, n s, W, d]`` whose pieces follow ``order``; one copy.

    Each source's share is ``pieces = len(order) / n`` equal pieces; piece ``m * pieces + p`` is piece
    ``p`` of member ``m``'s share; output piece ``i`` is piece ``order[i]`` (so the reorder by position
    costs nothing beyond the copy out of the receive buffer that any layout change needs)."""
    n, b, s, w, d = recv.shape
    pieces = len(order) // n
    split = recv.view(n, b, pieces, s // pieces, w, d)
    return torch.cat([split[i // pieces, :, i % pieces] for i in order], dim=1)


def _pack_heads(tensors: Sequence[torch.Tensor], n: int, order: Sequence[int]) -> torch.Tensor:
    """The inverse of ``_unpack_heads``: head shards ``[b, n s, W_i, d]`` laid out as ``order`` -> the send
    buffer ``[n (dest: the piece's owner), b, s, sum W_i, d]``, in one pass."""
    b, s_all, _, d = tensors[0].shape
    pieces = len(order) // n
    c = s_all // len(order)
    widths = [t.shape[2] for t in tensors]
    send = torch.empty((n, b, pieces, c, sum(widths), d), dtype=tensors[0].dtype, device=tensors[0].device)
    for position, piece in enumerate(order):
        m, p = divmod(piece, pieces)
        at = 0
        for t, w in zip(tensors, widths):
            send[m, :, p, :, at:at + w].copy_(t[:, position * c:(position + 1) * c])
            at += w
    return send.view(n, b, pieces * c, sum(widths), d)


def _unpack_seq(recv: torch.Tensor, widths: Sequence[int]) -> list[torch.Tensor]:
    """``recv [n (source: head owner), b, s, sum W_i, d]`` -> ``[b, s, n W_i, d]`` per tensor (one copy each)."""
    n, b, s, _, d = recv.shape
    out, at = [], 0
    for w in widths:
        out.append(recv[:, :, :, at:at + w].permute(1, 2, 0, 3, 4).reshape(b, s, n * w, d))
        at += w
    return out


def _slots(order: Sequence[int]) -> list[int]:
    """``slot[piece]``: where piece ``piece`` (member ``m``'s ``p``-th: ``m * pieces + p``) sits in ``order``."""
    slot = [0] * len(order)
    for i, piece in enumerate(order):
        slot[piece] = i
    return slot


def _scatter_in_place(xs: Sequence[torch.Tensor], group: CPGroup, order: Sequence[int]) -> torch.Tensor:
    """Batch-1 ``[1, s, H_i, d]`` sequence shares -> ``[1, n s, sum H_i / n, d]`` laid out as ``order``, with
    every piece received straight into its place (``all_to_all_pieces``): the one copy is the packing
    of what goes to the other members (this member's own pieces are copied into place directly)."""
    n, me = group.size, group.index
    _, s, _, d = xs[0].shape
    pieces = len(order) // n
    c = s // pieces
    widths = [x.shape[2] // n for x in xs]
    width, slot, others = sum(widths), _slots(order), [m for m in range(n) if m != me]
    heads = torch.empty((len(order), c, width, d), dtype=xs[0].dtype, device=xs[0].device)
    send = torch.empty((n - 1, pieces, c, width, d), dtype=xs[0].dtype, device=xs[0].device)
    at = 0
    for x, w in zip(xs, widths):
        split = x[0].unflatten(0, (pieces, c)).unflatten(2, (n, w))  # a view, whatever x's strides
        for i, m in enumerate(others):
            send[i, :, :, at:at + w].copy_(split[:, :, m])
        for p in range(pieces):
            heads[slot[me * pieces + p], :, at:at + w].copy_(split[p, :, me])
        at += w
    group.all_to_all_pieces([(m, send[i, p]) for i, m in enumerate(others) for p in range(pieces)],
                            [(m, heads[slot[m * pieces + p]]) for m in others for p in range(pieces)])
    release(send)
    return heads.view(1, len(order) * c, width, d)


def _gather_in_place(ys: Sequence[torch.Tensor], group: CPGroup, order: Sequence[int]) -> list[torch.Tensor]:
    """The inverse of ``_scatter_in_place`` per tensor: ``[1, n s, W_i, d]`` laid out as ``order`` ->
    ``[1, s, n W_i, d]``. Pieces go out straight from ``ys`` (a copy only where a piece is not
    contiguous); the one copy is from the receive buffers (and this member's pieces) into the result."""
    n, me = group.size, group.index
    _, s_all, _, d = ys[0].shape
    pieces = len(order) // n
    c = s_all // len(order)
    slot, others = _slots(order), [m for m in range(n) if m != me]
    recvs = [torch.empty((n - 1, pieces, c, y.shape[2], d), dtype=y.dtype, device=y.device) for y in ys]
    sends = [(m, y[0, slot[m * pieces + p] * c:(slot[m * pieces + p] + 1) * c].contiguous())
             for m in others for p in range(pieces) for y in ys]
    group.all_to_all_pieces(sends, [(m, r[i, p]) for i, m in enumerate(others) for p in range(pieces) for r in recvs])
    outs = []
    for y, recv in zip(ys, recvs):
        w = y.shape[2]
        out = torch.empty((pieces, c, n, w, d), dtype=y.dtype, device=y.device)
        for i, m in enumerate(others):
            out[:, :, m].copy_(recv[i])
        for p in range(pieces):
            out[p, :, me].copy_(y[0, slot[me * pieces + p] * c:(slot[me * pieces + p] + 1) * c])
        release(recv)
        outs.append(out.view(1, pieces * c, n * w, d))
    return outs


def _exchange(send: torch.Tensor, group: CPGroup) -> torch.Tensor:
    """``send``'s all-to-all into a new receive buffer; ``send`` is freed (``group_comm.release``)."""
    recv = torch.empty_like(send)
    group.all_to_all(recv, send)
    release(send)
    return recv


def _copied_out(recv: torch.Tensor, outs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``outs`` (unpacked from ``recv``) as tensors of their own, with ``recv`` freed at this point
    (``group_comm.release``). An output that is still a view of ``recv`` (one head per member: the
    reshape merges a size-1 dim) is copied first: otherwise it would keep ``recv`` alive, and gloo's
    worker with it, past the op (same values; only that tensor's strides differ)."""
    shared = recv.untyped_storage().data_ptr()
    owned = [o.clone(memory_format=torch.contiguous_format) if o.untyped_storage().data_ptr() == shared else o
             for o in outs]
    release(recv)
    return owned


class SeqToHeads(torch.autograd.Function):
    """``SeqToHeads.apply(group, order, *xs)``: each ``x [b, s_local, H_i, d]`` (sequence share, all heads)
    -> ``[b, n s_local, H_i / n, d]`` (every share, in piece ``order``; this member's heads), all in ONE
    all-to-all. The backward is the inverse, also one all-to-all."""

    @staticmethod
    def forward(ctx, group: CPGroup, order: list[int], *xs):
        n = group.size
        ctx.group, ctx.order, ctx.widths = group, order, [x.shape[2] // n for x in xs]
        if xs[0].shape[0] == 1:
            heads = _scatter_in_place(xs, group, order)
        else:
            recv = _exchange(_pack_seq(xs, n), group)
            (heads,) = _copied_out(recv, [_unpack_heads(recv, order)])
        return tuple(heads.split(ctx.widths, dim=2))

    @staticmethod
    def backward(ctx, *grads):
        if grads[0].shape[0] == 1:
            return (None, None, *_gather_in_place(grads, ctx.group, ctx.order))
        recv = _exchange(_pack_heads(grads, ctx.group.size, ctx.order), ctx.group)
        return (None, None, *_copied_out(recv, _unpack_seq(recv, ctx.widths)))


class HeadsToSeq(torch.autograd.Function):
    """``HeadsToSeq.apply(y, group, order)``: the inverse of ``SeqToHeads`` for one tensor."""

    @staticmethod
    def forward(ctx, y, group: CPGroup, order: list[int]):
        ctx.group, ctx.order = group, order
        if y.shape[0] == 1:
            return _gather_in_place([y], group, order)[0]
        recv = _exchange(_pack_heads([y], group.size, order), group)
        (out,) = _copied_out(recv, _unpack_seq(recv, [y.shape[2]]))
        return out

    @staticmethod
    def backward(ctx, grad):
        if grad.shape[0] == 1:
            return _scatter_in_place([grad], ctx.group, ctx.order), None, None
        recv = _exchange(_pack_seq([grad], ctx.group.size), ctx.group)
        (out,) = _copied_out(recv, [_unpack_heads(recv, ctx.order)])
        return out, None, None


def identity_order(group: CPGroup, pieces: int = 1) -> list[int]:
    """Pieces in member-major order (no reordering)."""
    return list(range(group.size * pieces))


def scatter_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: CPGroup, order: Sequence[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v from sequence shares to head shares in ONE all-to-all (kv heads repeated as needed).

    ``order`` (default member-major): the order of the gathered pieces along the sequence; each
    member's share is ``len(order) / n`` equal pieces, piece ``m * pieces + p`` is member ``m``'s ``p``-th."""
    n = group.size
    if n == 1:
        return q, k, v
    repeats = kv_repeats(q.shape[2], k.shape[2], n)
    if repeats > 1:
        k, v = k.repeat_interleave(repeats, dim=2), v.repeat_interleave(repeats, dim=2)
    return SeqToHeads.apply(group, list(order if order is not None else identity_order(group)), q, k, v)


def gather_heads(out: torch.Tensor, group: CPGroup, order: Sequence[int] | None = None) -> torch.Tensor:
    """The attention output (laid out as ``order``, see ``scatter_heads``) back to this rank's sequence share."""
    if group.size == 1:
        return out
    return HeadsToSeq.apply(out, group, list(order if order is not None else identity_order(group)))
