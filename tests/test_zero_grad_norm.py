"""The global grad norm's sum of squares (``zero.clip``: fp32 rows, fp64 across rows) and what a ZeRO
step allocates beyond its states, against the planner's step term (``planning.memory``).

- Accuracy: the sum of squares against float64 arithmetic on heavy-tailed values, at 1e-6 relative:
  the layout matrix's reference-stability bar (RTOL/10), so the norm cannot make layouts disagree.
- Layout independence: the norm ``ZeroOptimizer.step`` reports does not depend on where buckets cut
  the pieces (different bucket sizes) beyond that bar, and equals the float64 norm of the gradients.
- Memory: the CPU allocator's peak inside ``step`` (clipping on, so the clip coefficient scales the
  gradients) stays within the planner's AdamW / norm temporaries term (``step_temporaries``,
  ``SQ_SUM_TEMPORARY_BYTES``) plus a few KiB of scalars, and far below one shard-sized copy.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from parallel3d.parallel_state import ParallelState
from parallel3d.topology import Topology
from parallel3d.zero import ZeroOptimizer
from parallel3d.zero.adamw_multi import step_temporaries
from parallel3d.zero.clip import NORM_ROW, SQ_SUM_TEMPORARY_BYTES, _sq_sum
from tests.peak_rss import _allocator_peak

STABILITY = 1e-6  # the layout matrix's RTOL (1e-5) / 10: what the reference itself must stay within
SCALARS = 16 * 1024  # bytes of 0-d and per-row-count tensors a step may allocate besides its shard terms


def heavy_tailed(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.exp(2 * torch.randn(n, generator=g))


def test_sum_of_squares_matches_float64_on_a_large_piece():
    for n in (1_000_003, NORM_ROW * 4096, NORM_ROW - 1):  # a tail row, whole rows, no whole row
        x = heavy_tailed(n, seed=n)
        exact = float(x.double().square().sum())
        got = float(_sq_sum(x))
        assert abs(got - exact) <= STABILITY * exact, (n, got, exact)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(300, 300), nn.LayerNorm(300), nn.GELU(), nn.Linear(300, 301))


def _step(bucket_mb: float, clip: float | None, profile: bool = False) -> tuple[float, float, int, ZeroOptimizer]:
    model = _model()
    opt = ZeroOptimizer([model], ParallelState(Topology(tp=1, pp=1, dp=1)), zero_stage=0, lr=1e-3,
                        clip_grad=clip, bucket_size_mb=bucket_mb)
    x = torch.randn(64, 300, generator=torch.Generator().manual_seed(1))
    (model(x) * 10).square().mean().backward()
    reference = float(torch.sqrt(sum(p.grad.double().square().sum() for p in model.parameters())))
    if not profile:
        return opt.step().grad_norm, reference, 0, opt
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        info = opt.step()
    return info.grad_norm, reference, _step_allocations(prof), opt


def _step_allocations(prof) -> int:
    """Peak live bytes inside the profiled region above what was live when it began."""
    from torch._C._profiler import _EventType

    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.total_allocated, node.extra_fields.alloc_size))
        stack.extend(node.children)
    events.sort()
    before = events[0][1] - events[0][2]  # live bytes just before the first allocation
    return _allocator_peak(prof) - before


def test_norm_is_the_float64_norm_whatever_the_bucket_cuts():
    norms = []
    for bucket_mb in (0.05, 0.3, 4.0):  # pieces cut at different places
        norm, reference, _, _ = _step(bucket_mb, clip=None)
        assert abs(norm - reference) <= STABILITY * reference, (bucket_mb, norm, reference)
        norms.append(norm)
    assert max(norms) - min(norms) <= STABILITY * max(norms), norms


def test_step_allocates_no_shard_sized_temporary():
    norm, _, allocated, opt = _step(0.3, clip=0.5, profile=True)
    assert norm > 0.5  # the clip coefficient is applied: the in-place scaling path runs
    shard = opt.layouts[0].shard_numel
    largest_piece = max(b.piece_size for b in opt.layouts[0].buckets)
    planned = max(step_temporaries(True, "fused") * 4 * shard, SQ_SUM_TEMPORARY_BYTES * largest_piece)
    assert allocated <= planned + SCALARS, (allocated, planned, 4 * shard)
