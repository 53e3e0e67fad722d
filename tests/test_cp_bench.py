"""The CP micro-benchmark runs every variant and the ring-overlap timing on real ranks.

Timings are not asserted (noisy on shared CPUs; targets live in scripts/bench_cp.py):
this checks that the benchmark measures what it says, on the variants users run."""

from __future__ import annotations

import torch

from parallel3d.context_parallel.bench import bench_ring_overlap, bench_variants
from tests.cp_cases import Groups
from tests.harness import run_on_ranks


def _bench(rank, world):
    groups = Groups(rank, world, emulate_nccl=False)
    shape = dict(batch=1, seq_len=8, q_heads=4, kv_heads=2, head_dim=4, steps=1, warmup=0)
    variants = dict(groups.variants())
    times = bench_variants(groups.cp, variants=variants, **shape)
    overlap = bench_ring_overlap(groups.cp, **shape)
    return times, overlap


def test_bench_reports_every_variant_and_the_ring_overlap() -> None:
    for times, overlap in run_on_ranks(_bench, 2):
        assert set(times) == {"p2p", "allgather", "a2a", "a2a+p2p/1", "a2a+p2p/2"}
        assert all(t > 0 for t in times.values())
        assert overlap["comm_ms"] > 0 and overlap["compute_ms"] > 0 and overlap["overlapped_ms"] > 0
        assert 0.0 <= overlap["hidden"] <= 1.0
        # The direct reading: time blocked in the ring's waits, forward and backward.
        assert overlap["exposed_wait_ms"] >= 0 and 0.0 <= overlap["hidden_waits"] <= 1.0
        assert overlap["backward_comm_ms"] > 0 and overlap["backward_exposed_wait_ms"] > 0
        assert 0.0 <= overlap["backward_hidden_waits"] <= 1.0
