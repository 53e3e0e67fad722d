"""Generated context-parallel attention cases and the per-rank runner the CP tests share.

A case is drawn from a seed under the constraints of the cp size (heads that every tested
all-to-all size can split, a sequence of ``2 cp`` chunks); packed documents end at random
places and, on purpose, at chunk edges (a document ending on the last token of a chunk, and
one ending on the first token of a chunk). The reference is torch's own attention on the
whole sequence in float64; each rank compares its share of the output and of dq/dk/dv.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kernels.attention_math import attention_reference, block_mask
from parallel3d.comm import EmulatedP2PStreams
from parallel3d.context_parallel import (
    AttentionStats, CPGroup, context_parallel_attention, document_ids, hierarchical_rank_lists, split_for_cp,
)

EOD = 0


@dataclass(frozen=True)
class AttnCase:
    seed: int
    batch: int
    chunk: int  # tokens per chunk: s = 2 * cp * chunk
    q_heads: int
    kv_heads: int
    head_dim: int
    documents: bool


def a2a_sizes(cp: int) -> list[int]:
    return [a for a in range(1, cp + 1) if cp % a == 0]


def _splittable(hq: int, hk: int, sizes: list[int]) -> bool:
    return all(hq % a == 0 and (hk % a == 0 or a % hk == 0) for a in sizes)


def generate_cases(cp: int, count: int, seed: int) -> list[AttnCase]:
    """``count`` cases (half with documents) whose heads every a2a size of ``cp`` can split."""
    rng = random.Random(seed)
    heads = [(hk * g, hk) for hk in (1, 2, 3, 4, 6, 8) for g in (1, 2, 3) if _splittable(hk * g, hk, a2a_sizes(cp))]
    cases = []
    for i in range(count):
        hq, hk = rng.choice(heads)
        cases.append(AttnCase(seed=rng.randrange(10**6), batch=rng.choice((1, 2)), chunk=rng.choice((1, 2, 3, 5)),
                              q_heads=hq, kv_heads=hk, head_dim=rng.choice((4, 6, 8)), documents=i % 2 == 1))
    return cases


def case_tensors(case: AttnCase, cp: int) -> dict[str, torch.Tensor | None]:
    """Whole-sequence float64 q, k, v, dout and document ids (or None) of ``case``."""
    g = torch.Generator().manual_seed(case.seed)
    b, s, d = case.batch, 2 * cp * case.chunk, case.head_dim
    t = {
        "q": torch.randn(b, s, case.q_heads, d, generator=g, dtype=torch.float64),
        "k": torch.randn(b, s, case.kv_heads, d, generator=g, dtype=torch.float64),
        "v": torch.randn(b, s, case.kv_heads, d, generator=g, dtype=torch.float64),
        "dout": torch.randn(b, s, case.q_heads, d, generator=g, dtype=torch.float64),
        "document_ids": None,
    }
    if case.documents:
        tokens = torch.randint(1, 50, (b, s), generator=g)
        tokens[torch.rand(b, s, generator=g) < 0.15] = EOD
        edge = case.chunk * int(torch.randint(1, 2 * cp, (1,), generator=g))
        tokens[0, edge - 1] = EOD  # a document ends on a chunk's last token
        tokens[-1, min(edge, s - 1)] = EOD  # and one on a chunk's first token
        t["document_ids"] = document_ids(tokens, EOD)
    return t


def reference(t: dict) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    q, k, v = (t[n].clone().requires_grad_() for n in ("q", "k", "v"))
    out = attention_reference(q, k, v, document_ids=t["document_ids"])
    return out.detach(), torch.autograd.grad(out, (q, k, v), t["dout"])


def rel_err(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """Max abs error over the max magnitude of ``scale`` (default ``want``): a share's error is
    measured against the whole tensor (one rank's share of a gradient can be all but zero)."""
    scale = want if scale is None else scale
    return ((got.double() - want).abs().max() / scale.abs().max().clamp_min(1e-30)).item()


class Groups:
    """The cp group over all ranks and, per a2a size, this rank's a2a and ring sub-groups."""

    def __init__(self, rank: int, world: int, emulate_nccl: bool) -> None:
        streams = EmulatedP2PStreams() if emulate_nccl else None
        ranks = list(range(world))
        self.cp = CPGroup(dist.new_group(ranks), ranks, rank, p2p_streams=streams)
        self.sub: dict[int, tuple[CPGroup, CPGroup]] = {}
        for a in a2a_sizes(world):
            a2a_lists, ring_lists = hierarchical_rank_lists(ranks, a)
            mine = {}
            for kind, lists in (("cp_a2a", a2a_lists), ("cp_ring", ring_lists)):
                for members in lists:
                    # Every rank creates every group, in the same order (size-1 groups need none).
                    pg = dist.new_group(members) if len(members) > 1 else None
                    if rank in members:
                        mine[kind] = CPGroup(pg, members, rank, kind=kind, stats=self.cp.stats, p2p_streams=streams)
            self.sub[a] = (mine["cp_a2a"], mine["cp_ring"])

    def variants(self) -> list[tuple[str, dict]]:
        """``(label, keyword arguments)`` of every variant and every a2a size of ``a2a+p2p``."""
        out = [("p2p", {"cp_comm": "p2p"}), ("allgather", {"cp_comm": "allgather"}), ("a2a", {"cp_comm": "a2a"})]
        for a, (a2a, ring) in self.sub.items():
            out.append((f"a2a+p2p/{a}", {"cp_comm": "a2a+p2p", "a2a_group": a2a, "ring_group": ring}))
        return out


def wasted_blocks(stats: AttentionStats, docs: torch.Tensor | None, phase: str) -> int:
    """Computed blocks in which no query sees any key (what skipping must have avoided)."""
    wasted = 0
    for record in stats.blocks(phase):
        blk = record.block
        q_doc = None if docs is None else docs[:, blk.q.start:blk.q.end]
        k_doc = None if docs is None else docs[:, blk.k.start:blk.k.end]
        mask = block_mask(blk.q.length, blk.k.length, q_start=blk.q.start, k_start=blk.k.start, causal=True,
                          q_doc=q_doc, k_doc=k_doc)
        wasted += int(not bool(mask.any()))
    return wasted


def run_case(rank: int, groups: Groups, case: AttnCase, kwargs: dict, dtype: torch.dtype, backend: str) -> dict:
    """This rank's errors against the float64 whole attention, and what its attention computed."""
    cp = groups.cp.size
    t = case_tensors(case, cp)
    out_ref, grads_ref = reference(t)
    local = [split_for_cp(t[n], cp, rank).to(dtype).requires_grad_() for n in ("q", "k", "v")]
    before = [x.detach().clone() for x in local]
    stats = AttentionStats()
    groups.cp.stats.reset()
    out = context_parallel_attention(*local, cp_group=groups.cp, document_ids=t["document_ids"], backend=backend,
                                     stats=stats, **kwargs)
    forward_bytes = dict(groups.cp.stats.bytes)
    grads = torch.autograd.grad(out, local, split_for_cp(t["dout"], cp, rank).to(dtype))
    errors = {"out": rel_err(out, split_for_cp(out_ref, cp, rank), out_ref)}
    # Inputs are never written (a ring must not receive into the caller's K/V).
    errors["inputs_changed"] = max(float((x.detach() - b).abs().max()) for x, b in zip(local, before))
    for name, got, want in zip(("dq", "dk", "dv"), grads, grads_ref):
        errors[name] = rel_err(got, split_for_cp(want, cp, rank), want)
    return {
        "errors": errors,
        "query_positions": sorted(stats.query_positions()),
        "query_heads": sorted(stats.query_heads()),
        "causal_work": stats.causal_work(),
        "blocks": (len(stats.blocks("forward")), len(stats.blocks("backward"))),
        "skipped": {r: stats.skipped_count(r) for r in ("causal", "documents")},
        "wasted": wasted_blocks(stats, t["document_ids"], "forward") + wasted_blocks(stats, t["document_ids"], "backward"),
        "forward_bytes": forward_bytes,
        "dtype": str(out.dtype),
    }
