"""What one rank's attention computed: the blocks it ran and the blocks it skipped.

Filled by ``BlockAttention`` when an ``AttentionStats`` is passed to a context-parallel
attention call. Tests read it to prove that CP is on (each rank's queries are exactly its
share, the work is balanced, masked blocks are never computed); metrics can read the
score entries actually computed (attention FLOPs = 4 * d * entries * heads forward).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from parallel3d.context_parallel.blocks import Block, SkippedBlock


@dataclass(frozen=True)
class BlockRecord:
    phase: str  # "forward" or "backward"
    block: Block
    q_heads: int


@dataclass
class AttentionStats:
    computed: list[BlockRecord] = field(default_factory=list)
    skipped: list[SkippedBlock] = field(default_factory=list)

    def record(self, phase: str, block: Block, q_heads: int) -> None:
        self.computed.append(BlockRecord(phase, block, q_heads))

    def record_skipped(self, skipped: list[SkippedBlock]) -> None:
        self.skipped.extend(skipped)

    def blocks(self, phase: str = "forward") -> list[BlockRecord]:
        return [r for r in self.computed if r.phase == phase]

    def query_positions(self, phase: str = "forward") -> set[int]:
        """Global positions of the queries this rank computed attention for."""
        return {p for r in self.blocks(phase) for p in range(r.block.q.start, r.block.q.end)}

    def query_heads(self, phase: str = "forward") -> set[int]:
        return {r.q_heads for r in self.blocks(phase)}

    def score_entries(self, phase: str = "forward") -> int:
        """Query-key pairs in the computed blocks, per head (masked pairs inside a block count)."""
        return sum(r.block.q.length * r.block.k.length for r in self.blocks(phase))

    def causal_work(self, phase: str = "forward") -> int:
        """Causally visible (query, key) pairs in the computed blocks, summed over query heads: the
        work of a kernel that skips what the causal mask hides inside a block (documents ignored)."""
        return sum(_causal_pairs(r.block) * r.q_heads for r in self.blocks(phase))

    def skipped_count(self, reason: str | None = None) -> int:
        return sum(1 for s in self.skipped if reason is None or s.reason == reason)


def _causal_pairs(block: Block) -> int:
    """Pairs with key position <= query position in the block."""
    total = 0
    for q in range(block.q.start, block.q.end):
        total += max(0, min(block.k.end, q + 1) - block.k.start)
    return total
