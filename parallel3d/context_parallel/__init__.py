"""Context parallelism: one sequence split over the ranks of a cp group.

One concept per module:

- ``load_balance``: which chunks a cp rank holds (rank r: chunks r and 2cp-1-r of 2cp),
  splitting inputs / labels / positions the same way, and undoing it.
- ``documents``: document ids and per-document position ids of packed sequences.
- ``segments`` / ``blocks``: global position runs of local tensors, and which
  (query, key) blocks a causal, document-masked attention computes or skips.
- ``block_compute`` / ``blockwise``: one block's attention with its log-sum-exp (Triton,
  torch's CPU flash attention, or the fp32 math path) and the fp32 LSE merge.
- ``single_block``: a plan that is one fused block over the whole local sequence (``a2a``
  without documents) as one kernel call each way, with no accumulators.
- ``group_comm``: ``CPGroup``, the collectives of one cp (sub-)group with byte accounting
  and NCCL p2p semantics.
- ``ring`` (p2p), ``allgather``, ``ulysses`` (a2a), ``hierarchical`` (a2a+p2p): the
  ``parallel.cp_comm`` variants as autograd functions.
- ``attention``: ``context_parallel_attention``, the one entry point the model calls.
- ``stats``: what each rank's attention computed (tests, metrics).
- ``bench``: the micro-benchmark behind ``scripts/bench_cp.py``.

Public tensors are ``[b, s, h, d]``; nothing here holds module state or reads a topology:
every call gets its groups.
"""

from parallel3d.context_parallel.attention import CP_COMM_VARIANTS, context_parallel_attention, local_attention
from parallel3d.context_parallel.documents import document_ids, document_position_ids
from parallel3d.context_parallel.group_comm import CPGroup
from parallel3d.context_parallel.hierarchical import hierarchical_rank_lists
from parallel3d.context_parallel.load_balance import (
    local_positions, rank_segments, shift_labels, split_batch_for_cp, split_for_cp, unsplit_from_cp,
)
from parallel3d.context_parallel.stats import AttentionStats
from parallel3d.context_parallel.ulysses import HeadSplitError

__all__ = [
    "CP_COMM_VARIANTS", "context_parallel_attention", "local_attention", "document_ids", "document_position_ids",
    "CPGroup", "hierarchical_rank_lists", "local_positions", "rank_segments", "shift_labels", "split_batch_for_cp",
    "split_for_cp", "unsplit_from_cp", "AttentionStats", "HeadSplitError",
]
