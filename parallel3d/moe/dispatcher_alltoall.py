"""Dropless all-to-all token dispatch over the expert-parallel group, with expert TP.

Layout: ``E`` experts, ``ep`` ranks in the ``ep_group``, each holding ``E_l = E / ep``
consecutive experts (ep rank ``r``: ``[r * E_l, (r + 1) * E_l)``), each expert's FFN width
split over the ``etp`` ranks of its ``etp_group``. Every rank of the ep x etp grid holds
different tokens.

``dispatch(tokens [T, h], indices [T, k], keep)`` -> ``Dispatched``:

1. sort this rank's kept slots by expert (``ExpertOrder``; pairs in token order);
2. exchange the per-expert counts over ``ep`` (an async all-to-all of ``[E]`` int64 on
   the device), all-gather the received ``[ep, E_l]`` over ``etp``, and bring the sent and
   received counts to the host in ONE copy: the one device-to-host synchronisation (dropless,
   the expansion of the rows sent in step 3 needs no counts and runs while they are exchanged);
3. all-to-all the expanded rows over ``ep`` with uneven splits (received ``[src][e]``);
4. expert TP: all-gather the received rows over ``etp`` (every etp rank needs every row of
   its experts: each holds a slice of the FFN width), giving ``[member][src][e]``;
5. one permutation into expert order ``[e][src][member]``: the rows of local expert ``e``
   are contiguous, ``Dispatched.sizes[e]`` of them (skipped where the received order already is
   that order: one local expert, or ep = etp = 1).

``combine(expert_out, dispatched, weights [T, k])`` runs it backwards: un-permute,
reduce-scatter over ``etp`` (the FFN's second matmul gives partial sums over the width
slices: summed in member order, each rank keeps its own rows), the reverse all-to-all,
and the weighted sum of each token's ``k`` slots (``combine_from_experts``).

``pad_to_capacity``: every rank sends exactly ``capacity`` rows per expert (padding rows
are zeros and their outputs are discarded), so all sizes are known in advance: no count
exchange and no host synchronisation, at the price of padding. The capacity is the
micro-batch's (``parallel3d.moe.capacity``), so a rank pads up to it even though its share
of kept slots is smaller: the received rows grow with the token-group size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from parallel3d.moe.collectives import (
    ByteCounter, HostSyncs, all_gather_counts, all_to_all, exchange_counts, gather_rows,
    reduce_scatter_rows, to_host,
)
from parallel3d.moe.expert_layout import ExpertLayout
from parallel3d.moe.permutation import (
    ExpertOrder, chunk_permutation, combine_from_experts, expand_to_experts, permute_rows,
)


@dataclass
class Dispatched:
    """Rows for this rank's local experts, in expert order, and what ``combine`` needs to undo it."""

    rows: torch.Tensor
    sizes: list[int]
    order: ExpertOrder
    send_splits: list[int]
    recv_splits: list[int]
    etp_sizes: list[int]
    index: torch.Tensor | None  # None: the received rows are already in expert order (no permutation)
    inverse: torch.Tensor | None


class AllToAllDispatcher:
    """See the module docstring. Groups: ``ep_group`` (size ``ep``) and ``etp_group`` (size ``etp``)."""

    def __init__(self, num_experts: int, ep_group: "dist.ProcessGroup | None" = None,
                 etp_group: "dist.ProcessGroup | None" = None, *, pad_to_capacity: bool = False,
                 emulate_nccl: bool = False, comm_stats: ByteCounter | None = None) -> None:
        self.layout = ExpertLayout(num_experts, ep_group, etp_group)
        self.pad_to_capacity, self.emulate_nccl = pad_to_capacity, emulate_nccl
        self.comm_stats = comm_stats
        self.host_syncs = HostSyncs()

    def _counts(self, order: ExpertOrder, overlap: Callable[[], None]) -> tuple[list[int], list[list[list[int]]]]:
        """Host counts: sent per global expert ``[E]``, received ``[member][src][e]``; ``overlap()`` runs while
        the count all-to-all is in flight (work that needs no counts)."""
        lay = self.layout
        e_l = lay.local_experts
        pending = exchange_counts(order.counts, lay.ep_group, emulate_nccl=self.emulate_nccl, kind="ep",
                                  stats=self.comm_stats)
        overlap()
        received = pending.wait()  # [ep * E_l]: block i came from ep rank i
        received = all_gather_counts(received, lay.etp_group, kind="etp", stats=self.comm_stats)
        host = to_host(torch.cat([order.counts, received]), self.host_syncs)
        sent, got = host[:lay.num_experts], host[lay.num_experts:]
        per_member = lay.ep * e_l
        recv = [[got[m * per_member + s * e_l:m * per_member + (s + 1) * e_l] for s in range(lay.ep)]
                for m in range(lay.etp)]
        return sent, recv

    def dispatch(self, tokens: torch.Tensor, indices: torch.Tensor, keep: torch.Tensor | None = None,
                 capacity: int | None = None) -> Dispatched:
        """``tokens [T, h]``, ``indices [T, k]`` global expert ids, ``keep [T, k]`` (None: all kept)."""
        lay = self.layout
        ep, etp, e_l = lay.ep, lay.etp, lay.local_experts
        if self.pad_to_capacity:
            if keep is None or capacity is None:
                raise ValueError("pad_to_capacity needs the capacity mask and capacity")
            order = ExpertOrder.padded(indices, keep, lay.num_experts, capacity)
            sent = [capacity] * lay.num_experts
            recv = [[[capacity] * e_l for _ in range(ep)] for _ in range(etp)]
            rows = expand_to_experts(tokens, order)
        else:
            order = ExpertOrder.build(indices, keep, lay.num_experts)
            expanded: list[torch.Tensor] = []

            def expand_all_kept() -> None:  # dropless: the expansion needs no counts, so it overlaps their exchange
                if keep is None:
                    expanded.append(expand_to_experts(tokens, order.finish(None)))

            sent, recv = self._counts(order, expand_all_kept)
            if keep is None:
                order.sizes = list(sent)
                rows = expanded[0]
            else:
                rows = expand_to_experts(tokens, order.finish(sent))
        send_splits = [sum(sent[d * e_l:(d + 1) * e_l]) for d in range(ep)]
        recv_splits = [sum(recv[lay.etp_rank][s]) for s in range(ep)]
        rows = all_to_all(rows, lay.ep_group, send_splits, recv_splits, kind="ep", stats=self.comm_stats)
        etp_sizes = [sum(map(sum, recv[m])) for m in range(etp)]
        rows = gather_rows(rows, lay.etp_group, etp_sizes, kind="etp", stats=self.comm_stats)
        chunk_sizes = [recv[m][s][e] for m in range(etp) for s in range(ep) for e in range(e_l)]
        new_order = [(m * ep + s) * e_l + e for e in range(e_l) for s in range(ep) for m in range(etp)]
        index = inverse = None
        if new_order != sorted(new_order):  # ep = etp = 1 or one local expert: already in expert order
            index, inverse = chunk_permutation(chunk_sizes, new_order, tokens.device)
            rows = permute_rows(rows, index, inverse)
        sizes = [sum(recv[m][s][e] for m in range(etp) for s in range(ep)) for e in range(e_l)]
        return Dispatched(rows, sizes, order, send_splits, recv_splits, etp_sizes, index, inverse)

    def combine(self, expert_out: torch.Tensor, d: Dispatched, weights: torch.Tensor) -> torch.Tensor:
        """``expert_out`` rows (partial over etp) in ``d.rows``' order -> ``[T, h]`` weighted by ``weights [T, k]``."""
        lay = self.layout
        rows = expert_out if d.index is None else permute_rows(expert_out, d.inverse, d.index)
        rows = reduce_scatter_rows(rows, lay.etp_group, d.etp_sizes, kind="etp", stats=self.comm_stats)
        rows = all_to_all(rows, lay.ep_group, d.recv_splits, d.send_splits, kind="ep", stats=self.comm_stats)
        return combine_from_experts(rows, d.order, weights)
