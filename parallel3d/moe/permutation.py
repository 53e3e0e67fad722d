"""Moving token rows between token order and expert order, without atomics.

Terms: ``T`` tokens of hidden size ``h``, each routed to ``k`` (expert, weight) *slots*;
slot ``(t, j)`` is pair ``p = t * k + j``. A dropped slot (capacity) is routed nowhere.

``ExpertOrder`` lays the kept slots out by expert (within an expert in pair order, i.e. in
token order): ``token_of_row [N]`` / ``slot_of_row [N]`` say which slot each expert-ordered
row holds (-1: a padding row, pad-to-capacity only), ``slot_row [T, k]`` where each slot went
(-1: dropped), ``sizes`` the rows per expert (host integers).

- ``expand_to_experts(tokens, order)``: ``[T, h] -> [N, h]``, a token copied once per kept
  slot (zeros in padding rows). Backward: each token's ``k`` row gradients, summed in slot order.
- ``combine_from_experts(rows, order, weights)``: ``[N, h] -> [T, h]``,
  ``out[t] = sum_j weights[t, j] * rows[slot_row[t, j]]`` in fp32 (fp64 for fp64 rows) over ``j = 0..k-1``
  (dropped slots add nothing), returned in the rows' dtype.
- ``permute_rows(x, index, inverse)``: a pure row permutation; ``chunk_permutation`` builds
  one that reorders contiguous chunks (all-to-all blocks) into a new chunk order.

Every backward is a gather by a precomputed inverse map, never an ``index_add``: each
result row has one writer, so results are deterministic on every device and the order of
each sum is fixed, which is what lets an expert-parallel run equal the single process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class ExpertOrder:
    """Where the slots of ``num_tokens`` tokens go in expert order (see the module docstring)."""

    num_tokens: int
    top_k: int
    counts: torch.Tensor  # [E] kept slots per expert, on the device (before padding)
    sort: torch.Tensor | None = None  # pair ids in expert order, kept first (unpadded layout)
    sizes: list[int] | None = None
    token_of_row: torch.Tensor | None = None
    slot_of_row: torch.Tensor | None = None
    slot_row: torch.Tensor | None = None
    has_dropped: bool = False
    has_holes: bool = False

    @classmethod
    def build(cls, indices: torch.Tensor, keep: torch.Tensor | None, num_experts: int) -> "ExpertOrder":
        """``indices`` ``[T, k]`` global expert ids; ``keep`` ``[T, k]`` bool or None (all kept).

        Call ``finish(sizes)`` once the per-expert counts are on the host.
        """
        t, k = indices.shape
        flat = indices.reshape(-1)
        if keep is not None:
            flat = flat.masked_fill(~keep.reshape(-1), num_experts)  # dropped slots sort after every expert
        counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts]
        return cls(t, k, counts, sort=torch.argsort(flat, stable=True))

    def finish(self, sizes: Sequence[int] | None) -> "ExpertOrder":
        """``sizes``: the host counts; None where every slot is kept (``keep`` was None), which needs no counts,
        so the caller may expand while they are still being exchanged (set ``sizes`` later)."""
        n_kept = self.num_tokens * self.top_k if sizes is None else sum(sizes)
        self.sizes = None if sizes is None else list(sizes)
        self.has_dropped = n_kept < self.num_tokens * self.top_k
        kept = self.sort[:n_kept]
        self.token_of_row = torch.div(kept, self.top_k, rounding_mode="floor")
        self.slot_of_row = kept - self.token_of_row * self.top_k
        slot_row = torch.full((self.num_tokens * self.top_k,), -1, dtype=torch.int64, device=kept.device)
        slot_row[kept] = torch.arange(n_kept, device=kept.device)
        self.slot_row = slot_row.view(self.num_tokens, self.top_k)
        return self

    @classmethod
    def padded(cls, indices: torch.Tensor, keep: torch.Tensor, num_experts: int, capacity: int) -> "ExpertOrder":
        """Every expert gets exactly ``capacity`` rows (kept slots, then padding): no host sync.

        The capacity mask keeps at most ``capacity`` slots per expert; any beyond are dropped here.
        """
        t, k = indices.shape
        dev = indices.device
        flat = indices.reshape(-1).masked_fill(~keep.reshape(-1), num_experts)
        pair = torch.argsort(flat, stable=True)
        counts_all = torch.bincount(flat, minlength=num_experts + 1)
        start = torch.cumsum(counts_all, 0) - counts_all
        expert_sorted = flat[pair]
        rank = torch.arange(t * k, device=dev) - start[expert_sorted]
        rows = num_experts * capacity
        # A dropped pair goes to its own row past the layout (distinct, so the scatter has one writer per row).
        placed = (expert_sorted < num_experts) & (rank < capacity)
        dest_sorted = torch.where(placed, expert_sorted * capacity + rank, rows + pair)
        dest = torch.empty_like(dest_sorted)
        dest[pair] = dest_sorted
        pairs = torch.arange(t * k, device=dev)
        holder = torch.full((rows + t * k,), -1, dtype=torch.int64, device=dev).scatter_(0, dest, pairs)[:rows]
        token_of_row = torch.where(holder >= 0, torch.div(holder, k, rounding_mode="floor"), -1)
        slot_of_row = torch.where(holder >= 0, holder - token_of_row * k, 0)
        slot_row = torch.where(dest < rows, dest, -1).view(t, k)
        return cls(t, k, counts_all[:num_experts], sizes=[capacity] * num_experts, token_of_row=token_of_row,
                   slot_of_row=slot_of_row, slot_row=slot_row, has_dropped=True, has_holes=True)

    @property
    def num_rows(self) -> int:
        assert self.token_of_row is not None, "ExpertOrder.finish was not called"
        return self.token_of_row.numel()


def _gather_or_zero(src: torch.Tensor, index: torch.Tensor, holes: bool) -> torch.Tensor:
    """``src[index]`` along dim 0 with zero rows where ``index`` is -1 (``holes``: there may be some)."""
    if not holes:
        return src.index_select(0, index.reshape(-1))
    padded = torch.cat([src, src.new_zeros(1, *src.shape[1:])])  # the extra last row is the zero a hole reads
    return padded.index_select(0, index.reshape(-1).masked_fill(index.reshape(-1) < 0, src.shape[0]))


class _ExpandToExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, token_of_row, slot_row, has_holes, has_dropped):  # type: ignore[override]
        ctx.save_for_backward(slot_row)
        ctx.has_dropped = has_dropped
        return _gather_or_zero(tokens, token_of_row, has_holes)

    @staticmethod
    def backward(ctx, grad_rows):  # type: ignore[override]
        (slot_row,) = ctx.saved_tensors
        t, k = slot_row.shape
        per_slot = _gather_or_zero(grad_rows, slot_row, ctx.has_dropped).view(t, k, *grad_rows.shape[1:])
        return per_slot.sum(1), None, None, None, None


def expand_to_experts(tokens: torch.Tensor, order: ExpertOrder) -> torch.Tensor:
    """``[T, h]`` -> ``[N, h]`` in expert order (see the module docstring)."""
    return _ExpandToExperts.apply(tokens, order.token_of_row, order.slot_row, order.has_holes, order.has_dropped)


class _CombineFromExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, weights, slot_row, token_of_row, slot_of_row,  # type: ignore[override]
                has_holes, has_dropped):
        t, k = slot_row.shape
        acc = torch.promote_types(rows.dtype, torch.float32)
        per_slot = _gather_or_zero(rows, slot_row, has_dropped).view(t, k, *rows.shape[1:])
        # The weight gradient reads the gathered slots again: keep them (``[T, k, h]``, about the size of
        # ``rows``, which is then not kept) rather than gather a second time in backward.
        ctx.save_for_backward(per_slot, weights, token_of_row, slot_of_row)
        ctx.flags = (has_holes, rows.dtype)
        weighted = per_slot.to(acc) * weights.to(acc).unsqueeze(-1)  # a new tensor even where .to is a no-op
        return weighted.sum(1).to(rows.dtype)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        per_slot, weights, token_of_row, slot_of_row = ctx.saved_tensors
        has_holes, rows_dtype = ctx.flags
        grad_rows = grad_weights = None
        acc = torch.promote_types(rows_dtype, torch.float32)
        g = grad_out.to(acc)
        if ctx.needs_input_grad[0]:
            w = weights.to(acc)
            if has_holes:  # padding rows take no gradient: read the zero weight appended below
                w = torch.cat([w.reshape(-1), w.new_zeros(1)])
                flat = torch.where(token_of_row >= 0, token_of_row * weights.shape[1] + slot_of_row, w.numel() - 1)
                w_row = w[flat]
            else:
                w_row = w[token_of_row, slot_of_row]
            # The gather returns a fresh tensor: scale it in place (same product, one [N, h] buffer fewer).
            grad_rows = _gather_or_zero(g, token_of_row, has_holes).mul_(w_row.unsqueeze(-1)).to(rows_dtype)
        if ctx.needs_input_grad[1]:
            grad_weights = (per_slot.to(acc) * g.unsqueeze(1)).sum(-1).to(weights.dtype)
        return grad_rows, grad_weights, None, None, None, None, None


def combine_from_experts(rows: torch.Tensor, order: ExpertOrder, weights: torch.Tensor) -> torch.Tensor:
    """``[N, h]`` expert outputs -> ``[T, h]`` weighted by ``weights`` ``[T, k]`` (see module docstring)."""
    return _CombineFromExperts.apply(rows, weights, order.slot_row, order.token_of_row, order.slot_of_row,
                                     order.has_holes, order.has_dropped)


class _PermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, index, inverse):  # type: ignore[override]
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def permute_rows(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``x[index]``; ``inverse`` is ``index``'s inverse permutation (the backward's gather)."""
    return _PermuteRows.apply(x, index, inverse)


def chunk_permutation(sizes: Sequence[int], new_order: Sequence[int], device: torch.device
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index, inverse)`` that move contiguous chunks of ``sizes`` rows into ``new_order``.

    ``x[index]`` is chunk ``new_order[0]``, then chunk ``new_order[1]``, ...; ``y[inverse]``
    undoes it. Built on the device from host sizes (no synchronisation).
    """
    total = sum(sizes)
    size_t = torch.tensor(list(sizes), dtype=torch.int64, device=device)
    order_t = torch.tensor(list(new_order), dtype=torch.int64, device=device)
    start = torch.cumsum(size_t, 0) - size_t
    moved = size_t[order_t]
    new_start = torch.cumsum(moved, 0) - moved
    shift = torch.repeat_interleave(start[order_t] - new_start, moved, output_size=total)
    index = torch.arange(total, device=device) + shift
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(total, device=device)
    return index, inverse
