"""All-gather token dispatch: for small expert-parallel groups.

Same layout as ``dispatcher_alltoall`` (``E_l = E / ep`` consecutive experts per ep rank,
FFN width split over ``etp``, different tokens on every rank of the ep x etp grid).
Instead of sending each row to its expert's owner, every rank gathers every token of
the grid (over ``ep``, then ``etp``: order ``[member][src]``) with its routing, runs its
own experts on the slots routed to them, weights and sums them per token, and a
reduce-scatter (over ``etp``, then ``ep``) hands each rank the sum of all ranks'
partial outputs for its own tokens. More traffic than all-to-all for large groups
(every token to every rank), but one regular exchange and no per-destination splits.

Sizes: the ranks' token counts and per-expert slot counts are all-gathered in one
``[1 + E]`` vector per rank and reach the host in one copy (the one synchronisation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel3d.moe.collectives import (
    ByteCounter, HostSyncs, all_gather_counts, gather_rows, reduce_scatter_rows, to_host,
)
from parallel3d.moe.expert_layout import ExpertLayout
from parallel3d.moe.permutation import ExpertOrder, combine_from_experts, expand_to_experts


@dataclass
class Gathered:
    """Rows for this rank's local experts (expert order) over every token of the grid."""

    rows: torch.Tensor
    sizes: list[int]
    order: ExpertOrder
    ep_sizes: list[int]
    etp_sizes: list[int]


class AllGatherDispatcher:
    """See the module docstring. Groups: ``ep_group`` (size ``ep``) and ``etp_group`` (size ``etp``)."""

    def __init__(self, num_experts: int, ep_group: "dist.ProcessGroup | None" = None,
                 etp_group: "dist.ProcessGroup | None" = None, *, comm_stats: ByteCounter | None = None) -> None:
        self.layout = ExpertLayout(num_experts, ep_group, etp_group)
        self.comm_stats = comm_stats
        self.host_syncs = HostSyncs()

    def _gather(self, x: torch.Tensor, ep_sizes: list[int], etp_sizes: list[int]) -> torch.Tensor:
        x = gather_rows(x, self.layout.ep_group, ep_sizes, kind="ep", stats=self.comm_stats)
        return gather_rows(x, self.layout.etp_group, etp_sizes, kind="etp", stats=self.comm_stats)

    def dispatch(self, tokens: torch.Tensor, indices: torch.Tensor, keep: torch.Tensor | None = None,
                 capacity: int | None = None) -> Gathered:
        """``tokens [T, h]``, ``indices [T, k]``, ``keep [T, k]`` (None: all kept); ``capacity`` unused."""
        t, k = indices.shape
        lay = self.layout
        e, e_l, first, ep, etp = lay.num_experts, lay.local_experts, lay.first_expert, lay.ep, lay.etp
        routed = indices if keep is None else indices.masked_fill(~keep, -1)  # -1: a dropped slot
        counts = torch.bincount((routed + 1).reshape(-1), minlength=e + 1)[1:]
        mine = torch.cat([torch.tensor([t], dtype=torch.int64, device=indices.device), counts])
        grid = all_gather_counts(all_gather_counts(mine, lay.ep_group, kind="ep", stats=self.comm_stats),
                                 lay.etp_group, kind="etp", stats=self.comm_stats)
        host = to_host(grid, self.host_syncs)  # [member][src][1 + E]
        per = [host[i * (e + 1):(i + 1) * (e + 1)] for i in range(ep * etp)]
        ep_sizes = [per[lay.etp_rank * ep + s][0] for s in range(ep)]
        etp_sizes = [sum(per[m * ep + s][0] for s in range(ep)) for m in range(etp)]
        sizes = [sum(p[1 + first + j] for p in per) for j in range(e_l)]
        all_tokens = self._gather(tokens, ep_sizes, etp_sizes)
        all_routed = self._gather(routed, ep_sizes, etp_sizes)
        local = (all_routed >= first) & (all_routed < first + e_l)
        order = ExpertOrder.build((all_routed - first).clamp(0, e_l - 1), local, e_l).finish(sizes)
        rows = expand_to_experts(all_tokens, order)
        return Gathered(rows, sizes, order, ep_sizes, etp_sizes)

    def combine(self, expert_out: torch.Tensor, d: Gathered, weights: torch.Tensor) -> torch.Tensor:
        """``expert_out`` (partial over etp) -> ``[T, h]``: this rank's tokens, all experts' weighted sum."""
        all_weights = self._gather(weights, d.ep_sizes, d.etp_sizes)
        partial = combine_from_experts(expert_out, d.order, all_weights)
        lay = self.layout
        partial = reduce_scatter_rows(partial, lay.etp_group, d.etp_sizes, kind="etp", stats=self.comm_stats)
        return reduce_scatter_rows(partial, lay.ep_group, d.ep_sizes, kind="ep", stats=self.comm_stats)
