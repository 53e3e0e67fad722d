"""Stages 0/1 take each bucket's share of the global grad norm when its reduction completes
(``grad_replicated``: ``clip.counted_sq_sum`` of the reduced piece, handed to the step by ``reduced_sq_sum``).

- Exact: on 2 gloo ranks, through accumulation and several bucket cuts, the norm ``step`` reports is bitwise
  the norm read from the finalized pieces at the step (``global_grad_norm`` without the early sums: the
  step's old path) and within 1e-6 of the float64 norm of the reduced gradients; ``step`` itself computes no
  sum of squares (every bucket's was taken on completion).
- Safe: a gradient written after ``finalize`` (its buffer's version counter moved) makes the step read the
  pieces again, so the norm is the float64 norm of what the update will use, not of the stale sums.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from parallel3d.parallel_state import ParallelState
from parallel3d.topology import Topology
from parallel3d.zero import ZeroOptimizer, clip
from parallel3d.zero.assembly import DENSE_REDUCE_KIND, EXPERT_REDUCE_KIND
from parallel3d.zero.update import global_grad_norm
from tests.harness import run_on_ranks

DP = 2
STABILITY = 1e-6  # test_zero_grad_norm's bar: the norm against float64 arithmetic


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 24), nn.LayerNorm(24), nn.GELU(), nn.Linear(24, 24), nn.LayerNorm(24),
                         nn.Linear(24, 9))


def _batch(step: int, micro: int, rank: int) -> torch.Tensor:
    return torch.randn(5, 24, generator=torch.Generator().manual_seed(1000 * step + 10 * micro + rank)) * 3


def _counting(calls: list[int]):
    """``clip._sq_sum`` counting its calls in ``calls[0]``."""
    real = clip._sq_sum

    def counted(g: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return real(g)

    return counted


def _run(rank: int, world: int, stage: int, bucket_params: int) -> list[str]:
    model = _model()
    opt = ZeroOptimizer([model], ParallelState(Topology(tp=1, pp=1, dp=world)), zero_stage=stage, lr=1e-2,
                        clip_grad=1.0, overlap_param_gather=False, bucket_size_mb=bucket_params * 4 / 2**20)
    sync = opt.grad_sync
    problems = []
    for step, micros in enumerate((1, 2, 1, 3)):
        opt.zero_grad()
        for micro in range(micros):
            sync.prepare(micro == micros - 1)
            model(_batch(step, micro, rank)).square().mean().backward()
        sync.finalize()
        read = global_grad_norm(opt.layouts, sync.grad_piece, opt.pstate, kinds=(DENSE_REDUCE_KIND, EXPERT_REDUCE_KIND),
                                stage_of_kind=opt.stage_of_kind, inv_scale=1.0, device=opt.device)
        own = torch.zeros((), dtype=torch.float64)
        for g, layout in enumerate(opt.layouts):
            for b in layout.buckets:
                own += sync.grad_piece(g, b).double().square().sum()
        if stage == 1:  # shards: each rank's own pieces
            torch.distributed.all_reduce(own)
        exact = math.sqrt(float(own))
        calls, real = [0], clip._sq_sum
        clip._sq_sum = _counting(calls)  # this rank process's copy of the module, restored below
        try:
            got = opt.step().grad_norm
        finally:
            clip._sq_sum = real
        if got != read:
            problems.append(f"step {step}: norm {got!r} is not the pieces' {read!r} bitwise")
        if abs(got - exact) > STABILITY * exact:
            problems.append(f"step {step}: norm {got!r} vs float64 {exact!r}")
        if calls[0]:
            problems.append(f"step {step}: step() took {calls[0]} sums of squares (all were taken on completion)")
    return problems


@pytest.mark.parametrize("stage,bucket_params", [(0, 10**6), (0, 300), (1, 10**6), (1, 300)],
                         ids=["stage0-one-bucket", "stage0-buckets", "stage1-one-bucket", "stage1-buckets"])
def test_norm_taken_on_completion_is_the_norm_read_at_the_step(stage, bucket_params):
    for rank, problems in enumerate(run_on_ranks(_run, DP, stage, bucket_params, timeout=120)):
        assert not problems, f"rank {rank}: {problems}"


@pytest.mark.parametrize("write", ["mul_", "grad_attribute"])
def test_a_gradient_written_after_finalize_is_read_again(write):
    """One process: the sums taken on completion describe the gradients as ``finalize`` left them; a
    caller scaling a gradient afterwards (in place on its main grad, or on ``.grad``, the same view) gets
    the norm of the scaled gradients, which is what the update uses."""
    model = _model()
    opt = ZeroOptimizer([model], ParallelState(Topology(tp=1, pp=1, dp=1)), zero_stage=0, lr=1e-2, clip_grad=None,
                        bucket_size_mb=300 * 4 / 2**20)
    model(_batch(0, 0, 0)).square().mean().backward()
    opt.grad_sync.finalize()
    first = next(iter(model.parameters()))
    grad = opt.grad_sync.main_grad(first) if write == "mul_" else first.grad
    grad.mul_(7.0)
    exact = math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters()))
    got = opt.step().grad_norm
    assert abs(got - exact) <= STABILITY * exact, (got, exact)
