"""Which (query segment, key segment) blocks of a causal, document-masked attention to compute.

For query tokens laid out as ``q_segments`` and key tokens as ``k_segments`` (global
positions, see ``segments``), every pair of segments is one block, classified once:

- skipped (``reason="causal"``): every key comes after every query;
- skipped (``reason="documents"``): in every batch row the query and key document ranges
  do not overlap (needs no ordering of the ids: disjoint ranges share no id);
- computed, with ``causal=True`` when the causal mask cuts inside the block (else all its
  keys precede all its queries) and ``documents=True`` when some row's block spans more
  than one document (else one document covers it and no document mask is needed).

The plan only depends on positions and document ids, so a layer's forward plans once
and its backward reuses the plan. Document ranges are read to the host once per plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from parallel3d.context_parallel.segments import Segment, local_offsets


@dataclass(frozen=True)
class Block:
    """One computed block: global segments and where they sit in the local q / kv tensors."""

    q: Segment
    k: Segment
    q_offset: int
    k_offset: int
    causal: bool
    documents: bool

    @property
    def q_rows(self) -> slice:
        return slice(self.q_offset, self.q_offset + self.q.length)

    @property
    def k_rows(self) -> slice:
        return slice(self.k_offset, self.k_offset + self.k.length)

    @property
    def top_left_causal(self) -> bool:
        """The causal mask is ``key j <= query i`` inside the block (what fused kernels' is_causal means)."""
        return not self.causal or self.q.start == self.k.start


@dataclass(frozen=True)
class SkippedBlock:
    q: Segment
    k: Segment
    reason: str  # "causal" or "documents"


@dataclass
class BlockPlan:
    blocks: list[Block] = field(default_factory=list)
    skipped: list[SkippedBlock] = field(default_factory=list)


def _doc_ranges(document_ids: torch.Tensor, segments: list[Segment]) -> list[list[tuple[int, int]]]:
    """Per segment, per batch row: (min, max) document id."""
    if not segments:
        return []
    lows = torch.stack([document_ids[:, s.start:s.end].amin(dim=1) for s in segments])
    highs = torch.stack([document_ids[:, s.start:s.end].amax(dim=1) for s in segments])
    return [list(zip(lo, hi)) for lo, hi in zip(lows.tolist(), highs.tolist())]


def plan_blocks(
    q_segments: list[Segment], k_segments: list[Segment], document_ids: torch.Tensor | None = None
) -> BlockPlan:
    """Classify every (query segment, key segment) pair; see the module doc.

    ``document_ids [b, s]`` covers the whole sequence (global positions index it)."""
    plan = BlockPlan()
    q_docs = _doc_ranges(document_ids, q_segments) if document_ids is not None else None
    k_docs = _doc_ranges(document_ids, k_segments) if document_ids is not None else None
    for qi, (q, q_off) in enumerate(zip(q_segments, local_offsets(q_segments))):
        for ki, (k, k_off) in enumerate(zip(k_segments, local_offsets(k_segments))):
            if q.length == 0 or k.length == 0:
                continue
            if k.start > q.end - 1:
                plan.skipped.append(SkippedBlock(q, k, "causal"))
                continue
            documents = False
            if q_docs is not None and k_docs is not None:
                rows = list(zip(q_docs[qi], k_docs[ki]))
                if all(k_hi < q_lo or k_lo > q_hi for (q_lo, q_hi), (k_lo, k_hi) in rows):
                    plan.skipped.append(SkippedBlock(q, k, "documents"))
                    continue
                documents = not all(q_lo == q_hi == k_lo == k_hi for (q_lo, q_hi), (k_lo, k_hi) in rows)
            causal = k.end - 1 > q.start
            plan.blocks.append(Block(q, k, q_off, k_off, causal, documents))
    return plan
