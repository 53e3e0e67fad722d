"""Expert capacity: which routed slots are dropped, decided over a layout-independent set.

Definition (the contract every layout shares). The *drop set* is the whole micro-batch of
one data-parallel replica: every token of the micro-batch, gathered over the ranks that
split it (the *token group*: tp under sequence parallel, cp), never one rank's tokens.
Each token has a layout-independent id (``token_ids``: e.g. ``sequence * 2**32 + position``
within the micro-batch). For ``N`` tokens in the set, each expert keeps at most

    ``capacity = ceil(capacity_factor * N * top_k / num_experts)``

of the slots routed to it; the others are dropped (the token gets nothing from that
expert; its other slots keep their weights, not renormalised). Which slots it keeps:

- ``probs``: the highest router scores of that expert (the raw score of the chosen
  expert, not the normalised weight); ties by smaller token id, then smaller slot;
- ``position``: the smallest token ids (earliest in the micro-batch), then smaller slot.

Ranking uses only (expert, score, token id, slot), so the kept set is the same whatever
tp / cp / ep / pp split the micro-batch, and equals the single process on that micro-batch.
Routing is decided before dispatch, so the expert exchange never changes it.
Cost: the token group all-gathers ``[T, k]`` ids and scores (fp32) once per layer.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from parallel3d.moe.collectives import HostSyncs, gather_rows, gather_sizes, group_rank


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Slots one expert keeps out of a set of ``num_tokens`` tokens (see the module docstring)."""
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def keep_slots(indices: torch.Tensor, scores: torch.Tensor, token_ids: torch.Tensor, *, num_experts: int,
               capacity: int, policy: str) -> torch.Tensor:
    """``[N, k]`` bool: the kept slots of a whole drop set (one process, no communication)."""
    n, k = indices.shape
    experts = indices.reshape(-1)
    slots = torch.arange(k, device=indices.device).repeat(n)
    ids = token_ids.repeat_interleave(k)
    # Stable sorts from the least to the most significant key.
    order = torch.argsort(slots, stable=True)
    order = order[torch.argsort(ids[order], stable=True)]
    if policy == "probs":
        order = order[torch.argsort(scores.reshape(-1)[order], descending=True, stable=True)]
    elif policy != "position":
        raise ValueError(f"moe.drop_policy={policy!r}: allowed probs, position")
    order = order[torch.argsort(experts[order], stable=True)]
    counts = torch.bincount(experts, minlength=num_experts)
    first = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(n * k, device=indices.device) - first[experts[order]]
    keep = torch.empty(n * k, dtype=torch.bool, device=indices.device)
    keep[order] = rank_in_expert < capacity
    return keep.view(n, k)


def capacity_keep_mask(indices: torch.Tensor, scores: torch.Tensor, token_ids: torch.Tensor, *,
                       num_experts: int, capacity_factor: float, policy: str,
                       token_group: "dist.ProcessGroup | None", syncs: HostSyncs | None = None
                       ) -> tuple[torch.Tensor, int]:
    """This rank's ``[T, k]`` kept slots and the capacity, decided over the token group's whole set.

    ``indices``/``scores`` ``[T, k]`` (this rank's tokens), ``token_ids`` ``[T]`` int64.
    """
    t, k = indices.shape
    sizes = gather_sizes(t, token_group, indices.device, kind="moe_token", syncs=syncs)
    all_indices = gather_rows(indices, token_group, sizes, kind="moe_token")
    all_scores = gather_rows(scores.detach(), token_group, sizes, kind="moe_token")
    all_ids = gather_rows(token_ids, token_group, sizes, kind="moe_token")
    cap = expert_capacity(sum(sizes), k, num_experts, capacity_factor)
    keep = keep_slots(all_indices, all_scores, all_ids, num_experts=num_experts, capacity=cap, policy=policy)
    start = sum(sizes[:group_rank(token_group)])
    return keep[start:start + t], cap
