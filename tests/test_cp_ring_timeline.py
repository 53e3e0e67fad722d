"""The split of the ring's blocked time into a late neighbour and an uncovered transfer.

``split_blocked`` is checked against hand-built timelines whose answer follows from the
definition (a wait that starts before its neighbour posted is late until the post, then
transfer), and against a loop-by-loop reimplementation on random timelines. On real
gloo ranks, ``TimedRing`` records one event per exchange of the ring's forward and backward
and ``bench_ring_overlap`` reports the split. No timing is asserted."""

from __future__ import annotations

import random
import statistics

import pytest
import torch

from parallel3d.context_parallel.bench import bench_ring_overlap
from parallel3d.context_parallel.ring_timeline import split_blocked
from tests.cp_cases import Groups
from tests.harness import run_on_ranks


def _events(rows: list[list[tuple[float, float, float]]]) -> torch.Tensor:
    """``rows[rank][exchange] = (posted, wait start, wait end)``; CPU stamps set to 1 s of compute each."""
    return torch.tensor([[(p, s, e, 0.0, 1.0) for p, s, e in r] for r in rows], dtype=torch.float64)


def test_a_wait_on_a_neighbour_that_has_not_posted_is_late_then_transfer() -> None:
    # Three ranks, one exchange. Rank 1 waits on [10, 15]; its neighbours 0 and 2 posted at 9 and 13:
    # nothing could move before 13, so 3 s are late and 2 s transfer.
    # Rank 0 waits on [14, 14.5]; neighbours 2 and 1 posted at 13 and 5: all 0.5 s is transfer.
    # Rank 2 waits on [20, 20], nothing blocked.
    got = [split_blocked(_events([[(9, 14, 14.5)], [(5, 10, 15)], [(13, 20, 20)]]), 1, 0)]
    assert got[0]["late_ms"] == pytest.approx(3000) and got[0]["transfer_ms"] == pytest.approx(2000)
    # The largest over ranks is per reading: rank 0's transfer (0.5 s) does not win over rank 1's (2 s).
    only_rank0 = split_blocked(_events([[(9, 14, 14.5)], [(5, 10, 10)], [(13, 20, 20)]]), 1, 0)
    assert only_rank0["late_ms"] == pytest.approx(0) and only_rank0["transfer_ms"] == pytest.approx(500)


def test_the_two_neighbours_are_the_ranks_before_and_after() -> None:
    # Four ranks: rank 0's neighbours are 3 and 1, never 2. Rank 2 posts very late (100);
    # rank 0's wait [10, 12] must not be late because of it.
    got = split_blocked(_events([[(1, 10, 12)], [(1, 50, 50)], [(100, 100, 100)], [(1, 50, 50)]]), 1, 0)
    assert got["late_ms"] == pytest.approx(0) and got["transfer_ms"] == pytest.approx(2000)


def _reference(events: torch.Tensor, per_call: int, warmup: int) -> tuple[float, float]:
    n, total, _ = events.shape
    late_rank, xfer_rank = [], []
    for i in range(n):
        late_calls, xfer_calls = [], []
        for c in range(total // per_call):
            late = xfer = 0.0
            for e in range(c * per_call, (c + 1) * per_call):
                p_prev, p_next = float(events[(i - 1) % n, e, 0]), float(events[(i + 1) % n, e, 0])
                start, end = float(events[i, e, 1]), float(events[i, e, 2])
                ready = max(p_prev, p_next)
                blocked_after = max(0.0, end - max(start, ready))
                xfer += blocked_after
                late += (end - start) - blocked_after
            late_calls.append(late)
            xfer_calls.append(xfer)
        late_rank.append(statistics.median(late_calls[warmup:]))
        xfer_rank.append(statistics.median(xfer_calls[warmup:]))
    return max(late_rank) * 1e3, max(xfer_rank) * 1e3


@pytest.mark.parametrize("seed", range(5))
def test_split_matches_a_loop_reference_and_adds_up_to_the_blocked_time(seed: int) -> None:
    rng = random.Random(seed)
    n, per_call, calls, warmup = rng.choice([2, 3, 4, 5]), rng.choice([1, 3, 7]), rng.choice([1, 4, 5]), 0
    rows = []
    for _ in range(n):
        row = []
        for _ in range(per_call * calls):
            posted = rng.uniform(0, 10)
            start = posted + rng.uniform(0, 3)
            row.append((posted, start, start + rng.choice([0.0, rng.uniform(0, 4)])))
        rows.append(row)
    events = _events(rows)
    got = split_blocked(events, per_call, warmup)
    late, xfer = _reference(events, per_call, warmup)
    assert got["late_ms"] == pytest.approx(late) and got["transfer_ms"] == pytest.approx(xfer)
    # One rank blocked, the others not: its late + transfer is exactly its blocked time.
    for i in range(n):
        solo = events[:, :1].clone()
        solo[:, 0, 2] = solo[:, 0, 1]
        solo[i, 0, 2] = solo[i, 0, 1] + rng.uniform(0.1, 5)
        got = split_blocked(solo, 1, 0)
        blocked = float(solo[i, 0, 2] - solo[i, 0, 1]) * 1e3
        assert got["late_ms"] + got["transfer_ms"] == pytest.approx(blocked)


def _overlap(rank, world):
    groups = Groups(rank, world, emulate_nccl=False)
    return bench_ring_overlap(groups.cp, batch=1, seq_len=24, q_heads=4, kv_heads=2, head_dim=4, steps=2, warmup=1)


def test_bench_splits_the_blocked_time_of_forward_and_backward_on_real_ranks() -> None:
    for got in run_on_ranks(_overlap, 3):
        for prefix in ("", "backward_"):
            late, xfer = got[f"{prefix}late_wait_ms"], got[f"{prefix}transfer_wait_ms"]
            assert late >= 0 and xfer >= 0 and 0.0 <= got[f"{prefix}hidden_transfer"] <= 1.0
        # Each reading is the largest over ranks of a part of a rank's blocked time, so it cannot
        # exceed the largest blocked time (the median over one timed step is that step).
        assert got["late_wait_ms"] <= got["exposed_wait_ms"] + 1e-6
        assert got["transfer_wait_ms"] <= got["exposed_wait_ms"] + 1e-6
        lo, hi = got["compute_cpu_ms"]
        assert 0 < lo <= hi and got["compute_wall_ms"][0] > 0
        assert got["cores"] >= 1 and got["cores_busy_overlapped"] > 0
