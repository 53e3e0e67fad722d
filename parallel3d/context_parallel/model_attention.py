"""``ContextParallelAttention``: what a model layer needs to run its attention core over
the cp group of a job (the ``parallel.cp_comm`` variant and this rank's groups), and the
positions of this rank's tokens.

Invariant: built once per process by ``build`` (collective: every rank creates every
a2a+p2p sub-group, in the same order), then shared by every attention layer of every
model chunk. ``attend`` takes this rank's share ``[b, s/cp, h, d]`` and returns it attended
over the whole sequence; ``positions`` gives the global (or per-document) positions of the
share, so RoPE and learned position embeddings see where each token really sits.
With cp = 1 and no document mask the model does not use this class.
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from parallel3d.context_parallel.attention import context_parallel_attention
from parallel3d.context_parallel.group_comm import CPGroup
from parallel3d.context_parallel.hierarchical import hierarchical_rank_lists
from parallel3d.context_parallel.load_balance import local_positions, split_for_cp
from parallel3d.context_parallel.options import ContextParallelOptions
from parallel3d.context_parallel.stats import AttentionStats

if TYPE_CHECKING:  # pragma: no cover
    from parallel3d.parallel_state import ParallelState


def positions_in_documents(document_ids: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` positions that restart at 0 at each document's first token (``document_ids [b, s]``
    non-decreasing along the sequence, as ``documents.document_ids`` gives them)."""
    s = document_ids.shape[-1]
    idx = torch.arange(s, device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[..., 1:] = document_ids[..., 1:] != document_ids[..., :-1]
    return idx - torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=-1).values


class ContextParallelAttention:
    """One job's context-parallel attention: the variant and this rank's cp (sub-)groups."""

    def __init__(self, cp_comm: str, cp_group: CPGroup, a2a_group: CPGroup | None = None,
                 ring_group: CPGroup | None = None) -> None:
        self.cp_comm, self.cp_group = cp_comm, cp_group
        self.a2a_group, self.ring_group = a2a_group, ring_group
        self.stats: AttentionStats | None = None  # set by tests and benchmarks to record the blocks computed

    @classmethod
    def build(cls, pstate: "ParallelState", options: ContextParallelOptions,
              timeout_s: float | None = None) -> "ContextParallelAttention":
        """Collective over the world for ``a2a+p2p`` (it creates the sub-groups of every cp group)."""
        cp_group = CPGroup.from_pstate(pstate)
        if options.cp_comm != "a2a+p2p" or cp_group.size == 1:
            return cls(options.cp_comm if cp_group.size > 1 else "p2p", cp_group)
        timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
        mine: dict[str, CPGroup] = {}
        for cp_ranks in pstate.topology.groups("cp"):
            a2a_lists, ring_lists = hierarchical_rank_lists(cp_ranks, options.cp_a2a_size or 1)
            for kind, lists in (("cp_a2a", a2a_lists), ("cp_ring", ring_lists)):
                for ranks in lists:
                    # Every rank creates every group, in the same order (torch.distributed's rule).
                    group = dist.new_group(ranks=ranks, timeout=timeout) if len(ranks) > 1 else None
                    if pstate.rank in ranks:
                        mine[kind] = CPGroup(group, ranks, pstate.rank, kind="cp", stats=pstate.comm_stats,
                                             p2p_streams=pstate.emulated_p2p_streams)
        return cls("a2a+p2p", cp_group, mine["cp_a2a"], mine["cp_ring"])

    @property
    def size(self) -> int:
        return self.cp_group.size

    def positions(self, batch: int, seq_len: int, document_ids: torch.Tensor | None,
                  device: torch.device) -> torch.Tensor:
        """Positions of this rank's share of a ``seq_len`` sequence: ``[s/cp]``, or ``[b, s/cp]``
        restarting per document when ``document_ids [b, s]`` is given."""
        if document_ids is None:
            return local_positions(seq_len, self.size, self.cp_group.index, device=device)
        if tuple(document_ids.shape) != (batch, seq_len):
            raise ValueError(f"document_ids {tuple(document_ids.shape)} must be the whole sequence [b, s] = "
                             f"{(batch, seq_len)} on every cp rank")
        return split_for_cp(positions_in_documents(document_ids.to(device)), self.size, self.cp_group.index)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               document_ids: torch.Tensor | None) -> torch.Tensor:
        """This rank's share ``[b, s/cp, hq, d]`` attended over the whole (document-masked) sequence."""
        return context_parallel_attention(q, k, v, cp_comm=self.cp_comm, cp_group=self.cp_group,
                                          a2a_group=self.a2a_group, ring_group=self.ring_group,
                                          document_ids=document_ids, stats=self.stats)
