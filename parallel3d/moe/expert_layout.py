"""Which routed experts a rank holds: the one place that maps groups to expert indices.

With ``E`` experts over an expert-parallel group of ``ep`` ranks, ep rank ``r`` holds the
``E_l = E / ep`` consecutive experts ``[r * E_l, (r + 1) * E_l)``; over the expert-tensor-
parallel group of ``etp`` ranks, etp rank ``t`` holds slice ``t`` of each one's FFN width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from parallel3d.moe.collectives import group_rank, group_size


def check_expert_split(num_experts: int, ep: int, ffn_hidden: int | None = None, etp: int = 1) -> None:
    """Raise ValueError (one line, naming the config keys) unless ``ep`` ranks hold whole experts and
    ``etp`` ranks equal slices of each one's width: the rule the layers below apply, and which
    ``config.resolve`` applies to a job before any rank is started."""
    if num_experts % ep:
        raise ValueError(f"model.moe.num_experts={num_experts}: must be divisible by the expert-parallel size "
                         f"parallel.ep={ep}")
    if ffn_hidden is not None and ffn_hidden % etp:
        raise ValueError(f"model.moe.ffn_hidden_size={ffn_hidden} (the experts' width; null = model.ffn_hidden_size):"
                         f" must be divisible by the expert tensor-parallel size parallel.etp={etp} (null = tp)")


@dataclass(frozen=True)
class ExpertLayout:
    """``num_experts`` routed experts over ``ep_group`` x ``etp_group`` (None: a group of one)."""

    num_experts: int
    ep_group: "dist.ProcessGroup | None" = None
    etp_group: "dist.ProcessGroup | None" = None

    def __post_init__(self) -> None:
        check_expert_split(self.num_experts, self.ep)

    @property
    def ep(self) -> int:
        return group_size(self.ep_group)

    @property
    def etp(self) -> int:
        return group_size(self.etp_group)

    @property
    def etp_rank(self) -> int:
        return group_rank(self.etp_group)

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.ep

    @property
    def first_expert(self) -> int:
        return group_rank(self.ep_group) * self.local_experts
