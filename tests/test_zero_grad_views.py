"""Stages 0/1's gradient path (``grad_replicated``): ``zero_grad`` sets every ``.grad`` to None and writes
nothing into the gradient buffer; each parameter's first gradient of a step is written into its view (on the
backward completing its accumulation, already multiplied by the reducer's ``1/n``), later microbatches add
there in place, a parameter without a gradient gets a zeroed view at ``finalize``, and after ``finalize``
every ``.grad`` is its view holding the DP mean.

Checked on 2 gloo ranks against a float64 reference (each rank's gradients computed by a plain copy of the
model, the replicas' mean in float64, rounded once: exact for two replicas, see ``_mean``), through
accumulation, a bucket mixing scaled and unscaled slots, an unused parameter whose view holds an older
step's values, and bf16 parameters with fp32 main grads. The passes over the buffer are counted by a
dispatch mode that sees every aten op writing into its storage (autograd's own ``+=`` included)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from parallel3d.parallel_state import ParallelState
from parallel3d.topology import Topology
from parallel3d.zero import ZeroOptimizer
from tests.harness import run_on_ranks

DP = 2


class _Net(nn.Module):
    """``b`` takes part only when asked: an unused parameter, or one first seen in a later microbatch."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if use_b:
            h = h + torch.tanh(self.b(h))
        return self.c(h).float().pow(2).sum()


def _batch(step: int, micro: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(3, 8, generator=torch.Generator().manual_seed(100 * step + 10 * micro + rank)).to(dtype)


# Per step: which microbatches use ``b``. Step 0: ``b`` first appears in the last microbatch (its slot is written
# scaled while ``a`` and ``c`` were accumulated: a mixed bucket when they share one); step 1: one microbatch
# (every slot written scaled: no bucket pass); step 2: ``b`` unused (its view holds step 1's mean); step 3: ``b`` only
# in the first microbatch (bound, never counted ready: its bucket is launched by ``finalize``).
SCHEDULE = ((False, True), (True,), (False,), (True, False))


def _local_sum(model: nn.Module, step: int, rank: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Rank ``rank``'s gradient of the step as its buffer must hold it before the reduction: autograd's own
    ``.grad`` accumulation (fp32 params), or the fp32 sum of each microbatch's bf16 ``.grad`` (main grads)."""
    ref = copy.deepcopy(model)
    params = list(ref.parameters())
    total = [torch.zeros(p.shape, dtype=torch.float32) for p in params]
    for micro, use_b in enumerate(SCHEDULE[step]):
        if dtype != torch.float32:
            ref.zero_grad()
        ref(_batch(step, micro, rank, dtype), use_b).backward()
        if dtype != torch.float32:
            for t, p in zip(total, params):
                if p.grad is not None:
                    t.add_(p.grad.float())
    if dtype == torch.float32:
        total = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
    return total


def _mean(step: int, model: nn.Module, dtype: torch.dtype) -> list[torch.Tensor]:
    """The replicas' mean in float64, rounded to fp32 once (with two replicas the fp32 halves' sum is
    that value exactly, so equality is the test)."""
    per_rank = [_local_sum(model, step, r, dtype) for r in range(DP)]
    return [(sum(g[i].double() for g in per_rank) / DP).float() for i in range(len(per_rank[0]))]


class _BufferWrites(TorchDispatchMode):
    """Elements written by aten ops into ``storage`` (in-place and ``out=`` arguments aliasing it)."""

    def __init__(self, storage_ptr: int) -> None:
        super().__init__()
        self.ptr, self.elements = storage_ptr, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "aten":
            for arg, value in zip(func._schema.arguments, args):
                self._count(arg, value)
            for arg in func._schema.arguments:
                if arg.name in kwargs:
                    self._count(arg, kwargs[arg.name])
        return func(*args, **kwargs)

    def _count(self, arg, value) -> None:
        if (isinstance(value, torch.Tensor) and arg.alias_info is not None and arg.alias_info.is_write
                and value.untyped_storage().data_ptr() == self.ptr):
            self.elements += value.numel()


def _run(rank: int, world: int, stage: int, dtype: torch.dtype, bucket_params: int) -> list[str]:
    torch.manual_seed(0)
    model = _Net().to(dtype)
    initial = copy.deepcopy(model)
    opt = ZeroOptimizer([model], ParallelState(Topology(tp=1, pp=1, dp=world)), zero_stage=stage, lr=1e-3,
                        clip_grad=None, overlap_param_gather=False, precision="bf16" if dtype != torch.float32 else "fp32",
                        grad_reduce_dtype="fp32", bucket_size_mb=bucket_params * 4 / 2**20)
    sync = opt.grad_sync
    params = list(model.parameters())
    buffer = sync.gradient_tensors()[0]
    used = sum(p.numel() for p in params)
    index_of = {id(p): i for i, p in enumerate(params)}
    problems = []
    for step, micros in enumerate(SCHEDULE):
        counter = _BufferWrites(buffer.untyped_storage().data_ptr())
        with counter:
            sync.zero_grad()
        if counter.elements:
            problems.append(f"step {step}: zero_grad wrote {counter.elements} buffer elements")
        if any(p.grad is not None for p in params):
            problems.append(f"step {step}: a .grad survived zero_grad")
        counter = _BufferWrites(buffer.untyped_storage().data_ptr())
        with counter:
            for micro, use_b in enumerate(micros):
                sync.prepare(micro == len(micros) - 1)
                model(_batch(step, micro, rank, dtype), use_b).backward()
            sync.finalize()
        if stage == 0 and dtype == torch.float32 and len(micros) == 1 and all(micros):
            # One pass: each gradient written once, already scaled (no zeroing, no add, no bucket scaling).
            if counter.elements != used:
                problems.append(f"step {step}: {counter.elements} buffer elements written, one pass is {used}")
        want = _mean(step, initial, dtype)
        for layout_index, layout in enumerate(opt.layouts):
            for b in layout.buckets:
                piece = sync.grad_piece(layout_index, b)
                for seg in b.segments:
                    i = index_of[id(seg.slot.param)]
                    lo = seg.shard_start - b.shard_offset
                    got = piece[lo : lo + seg.length]
                    ref = want[i].reshape(-1)[seg.param_start : seg.param_start + seg.length]
                    if not torch.equal(got, ref):
                        problems.append(f"step {step}: {seg.slot.name} differs by {(got - ref).abs().max().item():.3g}")
        if dtype == torch.float32:
            for p in params:
                if p.grad is not sync.main_grad(p):
                    problems.append(f"step {step}: .grad is not its view after finalize")
        sync.reset()  # no update: every step's reference starts from the same weights
    return problems


@pytest.mark.parametrize("stage,dtype,bucket_params", [
    (0, torch.float32, 10**6),  # one bucket: step 0's is mixed (b written scaled, a and c accumulated)
    (0, torch.float32, 40),  # a bucket per parameter
    (1, torch.float32, 10**6),
    (0, torch.bfloat16, 10**6),  # fp32 main grads: cast-writes, adds, the bucket pass
], ids=["stage0-one-bucket", "stage0-buckets", "stage1", "stage0-bf16-main-grads"])
def test_first_write_matches_the_float64_mean_in_one_pass(stage, dtype, bucket_params):
    for rank, problems in enumerate(run_on_ranks(_run, DP, stage, dtype, bucket_params, timeout=120)):
        assert not problems, f"rank {rank}: {problems}"


def test_zero_grad_drops_every_grad_and_a_later_grad_is_written():
    """One process: ``zero_grad`` drops whatever ``.grad`` was (torch's ``set_to_none``); a ``.grad`` the caller
    sets afterwards is the start of the sum (autograd adds into it) and lands in the view."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4))
    reference = copy.deepcopy(model)
    opt = ZeroOptimizer([model], ParallelState(Topology(tp=1, pp=1, dp=1)), zero_stage=0, lr=1e-3, clip_grad=None)
    x = torch.randn(2, 8)
    model(x).sum().backward()
    params = list(model.parameters())
    params[1].grad = torch.full_like(params[1], 3.0)  # replaced by another tensor
    opt.zero_grad()
    assert all(p.grad is None for p in params)
    params[1].grad = torch.full_like(params[1], 3.0)
    reference_params = list(reference.parameters())
    reference_params[1].grad = torch.full_like(params[1], 3.0)
    model(x).sum().backward()
    reference(x).sum().backward()
    opt.grad_sync.finalize()
    for p, r in zip(params, reference_params):
        assert p.grad is opt.grad_sync.main_grad(p)
        assert torch.equal(p.grad, r.grad)
