"""``context_parallel_attention``: causal (and document-masked) attention over a cp group.

Every cp rank calls it with its load-balanced share (``load_balance.split_for_cp``) of
``q [b, s_local, hq, d]``, ``k``/``v [b, s_local, hk, d]`` (after RoPE with the share's
position ids) and gets ``[b, s_local, hq, d]``: its queries attended over the whole
sequence. ``document_ids [b, s]`` (the whole sequence, the same on every cp rank) keeps
attention inside each packed document. ``cp_comm`` picks how keys and values move:

- ``p2p``: ring over ``cp_group`` (``ring``);
- ``allgather``: all-gather over ``cp_group`` (``allgather``);
- ``a2a``: Ulysses all-to-all over ``cp_group`` (``ulysses``, ``hierarchical``);
- ``a2a+p2p``: all-to-all over ``a2a_group``, ring over ``ring_group``: this rank's
  sub-groups of ``cp_group`` from ``hierarchical.hierarchical_rank_lists`` (required).

All are differentiable (q, k, v). ``backend``: see ``block_compute`` (``auto``, ``triton``,
``torch``, ``math``). ``stats``: an ``AttentionStats`` that records the blocks computed
and skipped on this rank.
"""

from __future__ import annotations

import torch

from kernels.attention_math import default_scale
from parallel3d.context_parallel.allgather import AllGatherAttention
from parallel3d.context_parallel.block_compute import BlockAttention, resolve_attention_backend
from parallel3d.context_parallel.group_comm import CPGroup
from parallel3d.context_parallel.hierarchical import ulysses_ring_attention
from parallel3d.context_parallel.load_balance import rank_segments
from parallel3d.context_parallel.stats import AttentionStats

CP_COMM_VARIANTS = ("p2p", "allgather", "a2a", "a2a+p2p")


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids, cp: int) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"context-parallel attention: q [b, s, hq, d] and k = v [b, s, hk, d] expected, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"context-parallel attention: {q.shape[2]} query heads do not group over {k.shape[2]} kv heads")
    whole = (q.shape[0], q.shape[1] * cp)
    if document_ids is not None and tuple(document_ids.shape) != whole:
        raise ValueError(f"document_ids {tuple(document_ids.shape)} must cover the whole sequence [b, s] = "
                         f"{whole} (s = {q.shape[1]} local tokens x cp {cp}) on every cp rank")


def _sub_groups(cp_comm: str, cp_group: CPGroup, a2a_group, ring_group) -> tuple[CPGroup, CPGroup]:
    if cp_comm == "p2p":
        return CPGroup.single(), cp_group
    if cp_comm == "a2a":
        return cp_group, CPGroup.single()
    if a2a_group is None or ring_group is None:
        raise ValueError("cp_comm='a2a+p2p' needs this rank's a2a and ring sub-groups (parallel.cp_a2a_size; "
                         "see hierarchical_rank_lists): refusing to fall back to another variant")
    a = a2a_group.size
    if a * ring_group.size != cp_group.size or cp_group.index != ring_group.index * a + a2a_group.index:
        raise ValueError(
            f"rank {cp_group.rank}: a2a group {a2a_group.ranks} x ring group {ring_group.ranks} do not tile the cp "
            f"group {cp_group.ranks} as hierarchical_rank_lists does"
        )
    return a2a_group, ring_group


def context_parallel_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cp_comm: str, cp_group: CPGroup,
    a2a_group: CPGroup | None = None, ring_group: CPGroup | None = None,
    document_ids: torch.Tensor | None = None, backend: str = "auto", scale: float | None = None,
    stats: AttentionStats | None = None,
) -> torch.Tensor:
    """This rank's share of causal attention over the cp group; see the module doc."""
    if cp_comm not in CP_COMM_VARIANTS:
        raise ValueError(f"parallel.cp_comm={cp_comm!r} is not one of {', '.join(CP_COMM_VARIANTS)}")
    cp = cp_group.size
    _check_inputs(q, k, v, document_ids, cp)
    scale = default_scale(q.shape[-1]) if scale is None else scale
    engine = BlockAttention(resolve_attention_backend(backend, q), scale, document_ids, stats)
    if cp_comm == "allgather":
        seq_len = q.shape[1] * cp
        members = [rank_segments(seq_len, cp, j) for j in range(cp)]
        return AllGatherAttention.apply(q, k, v, cp_group, members[cp_group.index], members, engine)
    a2a, ring = _sub_groups(cp_comm, cp_group, a2a_group, ring_group)
    return ulysses_ring_attention(q, k, v, a2a=a2a, ring=ring, engine=engine)


def local_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, document_ids: torch.Tensor | None = None,
    backend: str = "auto", scale: float | None = None, stats: AttentionStats | None = None,
) -> torch.Tensor:
    """cp = 1: the same blockwise path on one rank (``[b, s, h, d]`` in and out)."""
    return context_parallel_attention(q, k, v, cp_comm="p2p", cp_group=CPGroup.single(), document_ids=document_ids,
                                      backend=backend, scale=scale, stats=stats)
