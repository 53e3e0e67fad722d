"""Zero-copy gradient buckets (ZeRO 0-2): each parameter's main grad is a view of its bucket's
contiguous buffer, autograd accumulates straight into it (same dtype), and each bucket's
reduction is launched from the gradient hook on that buffer, as a true reduce-scatter for
stages 1-2. The gradients the optimizer reads are checked against a float64 single-process
sum of every rank's gradients, over several steps (a bucket not zeroed between steps, or
the wrong piece kept, shows there)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from parallel3d.parallel_state import ParallelState
from parallel3d.topology import Topology
from parallel3d.zero import ZeroOptimizer
from tests.harness import run_on_ranks

DP = 2
ACC = 2  # microbatches per step
STEPS = 2
BUCKET_ELEMS = 300  # several buckets, several parameters per bucket


def make_model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 10), nn.Tanh(), nn.Linear(10, 7),
                         nn.LayerNorm(7)).to(dtype)


def microbatch(rank: int, step: int, mb: int) -> torch.Tensor:
    return torch.randn(3, 12, generator=torch.Generator().manual_seed(100 * step + 10 * mb + rank))


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().pow(2).mean() / ACC


def reference_grads(step: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The replica-mean gradient of step ``step`` in float64 (each rank's microbatches summed in
    float64, from the step's parameters in ``dtype`` promoted to float64)."""
    out: dict[str, torch.Tensor] = {}
    model = make_model(dtype).double()
    for rank in range(DP):
        for mb in range(ACC):
            model.zero_grad()
            loss_of(model, microbatch(rank, step, mb).double()).backward()
            for name, p in model.named_parameters():
                out[name] = out.get(name, 0) + p.grad / DP
    return out


def _run(rank: int, world_size: int, stage: int, precision: str) -> dict:
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    ps = ParallelState(Topology(tp=1, pp=1, dp=world_size))
    model = make_model(dtype)
    names = {id(p): n for n, p in model.named_parameters()}
    seen_by_autograd: dict[str, list[bool]] = {n: [] for n in names.values()}
    holder: dict[str, ZeroOptimizer] = {}

    def before_zero(p: torch.nn.Parameter) -> None:  # runs before the optimizer's hook
        main = holder["opt"].grad_sync.main_grad(p)
        seen_by_autograd[names[id(p)]].append(main is not None and p.grad is not None
                                              and p.grad.data_ptr() == main.data_ptr())

    for p in model.parameters():  # registered first, so it sees what AccumulateGrad left in .grad
        p.register_post_accumulate_grad_hook(before_zero)
    opt = ZeroOptimizer([model], ps, zero_stage=stage, lr=0.0, precision=precision, weight_decay=0.0,
                        bucket_size_mb=BUCKET_ELEMS * dtype.itemsize / 2**20, overlap_param_gather=False)
    holder["opt"] = opt
    sync = opt.grad_sync
    layout = opt.layouts[0]
    where = {id(s.param): (b, s) for b in layout.buckets for s in b.slots}
    checks = {"views": 0, "bad_views": [], "autograd_in_bucket": 0}

    class Observer:  # told after the optimizer's hook consumed a gradient
        def grad_consumed(self, p: torch.nn.Parameter, is_last: bool) -> None:
            b, s = where[id(p)]
            main = sync.main_grad(p)
            if main is None:  # stage 2: the bucket was just reduced; its buffer is gone
                return
            if stage < 2:  # the persistent buffer, at the slot's offset
                base, offset = sync.grad_bufs[0].data, s.start
            else:  # a pooled bucket buffer, at the slot's offset inside the bucket
                base = next(buf for buf in sync.staging_buffers()
                            if buf.untyped_storage().data_ptr() == main.untyped_storage().data_ptr())
                offset = s.start - b.start
            ok = (main.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
                  and main.storage_offset() - base.storage_offset() == offset and main.shape == p.shape
                  and main.dtype == sync.grad_dtype)
            if dtype == sync.grad_dtype:  # zero-copy: .grad is the view itself
                ok = ok and p.grad is not None and p.grad.data_ptr() == main.data_ptr()
            else:  # fp32 main grads of a bf16 model: the half-precision .grad is dropped
                ok = ok and p.grad is None
            checks["views"] += 1
            if not ok:
                checks["bad_views"].append(names[id(p)])

        def grads_finalized(self) -> None:
            pass

    sync.add_observer(Observer())
    grads_per_step = []
    launched_in_backward = []
    for step in range(STEPS):
        ps.comm_stats.reset()
        for mb in range(ACC):
            sync.prepare(is_last_microbatch=mb == ACC - 1)
            loss_of(model, microbatch(rank, step, mb).to(dtype)).backward()
        launched_in_backward.append(dict(ps.comm_stats.calls))
        sync.finalize()
        pieces = {}
        for b in layout.buckets:
            piece = sync.grad_piece(0, b)
            for seg in b.segments:
                lo = seg.shard_start - b.shard_offset
                pieces[(seg.slot.name, seg.param_start)] = piece[lo : lo + seg.length].double().clone()
        grads_per_step.append(pieces)
        opt.step()  # lr 0: the parameters stay those of make_model
        opt.zero_grad()
    checks["autograd_in_bucket"] = sum(any(v) for v in seen_by_autograd.values())
    return dict(grads=grads_per_step, checks=checks, calls=launched_in_backward, buckets=len(layout.buckets),
                params=len(names))


CASES = [(stage, precision) for stage in (0, 1, 2) for precision in ("fp32", "bf16")]


@pytest.mark.parametrize("stage,precision", CASES)
def test_main_grads_are_bucket_views_and_reduce_from_the_hook(stage, precision):
    results = run_on_ranks(_run, DP, stage, precision, timeout=180)
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    # bf16 parameters: each microbatch's bf16 gradient is rounded before the fp32 sum (fp32 main grads).
    tol = 1e-5 if precision == "fp32" else 2e-2
    refs = [reference_grads(step, dtype) for step in range(STEPS)]
    for rank, r in enumerate(results):
        c = r["checks"]
        assert c["views"] > 0 and not c["bad_views"], (rank, c["bad_views"])
        if precision == "fp32":  # same dtype: autograd itself added into the bucket (no hook copy)
            # stage 0/1: every parameter; stage 2: all but the first parameter of each bucket
            least = r["params"] if stage < 2 else r["params"] - r["buckets"]
            assert c["autograd_in_bucket"] >= least, (rank, c["autograd_in_bucket"], least)
        for step, calls in enumerate(r["calls"]):
            # Every bucket's reduction was launched inside backward (from the hook): stage 0 one
            # all-reduce per bucket, stages 1-2 a true reduce-scatter (no all-reduce), stage 2 on
            # every microbatch.
            op = "all_reduce" if stage == 0 else "reduce_scatter"
            other = "reduce_scatter" if stage == 0 else "all_reduce"
            per_step = r["buckets"] * (ACC if stage == 2 else 1)
            assert calls.get(("dp_cp", op), 0) == per_step, (rank, step, calls)
            assert calls.get(("dp_cp", other), 0) == 0, (rank, step, calls)
        # What the optimizer reads: this rank's pieces of the replica-mean gradient.
        for step, pieces in enumerate(r["grads"]):
            assert pieces
            # Relative to the step's largest gradient: a bias before LayerNorm has a tiny gradient
            # made of cancelling terms.
            scale = max(float(g.abs().max()) for g in refs[step].values())
            for (name, start), got in pieces.items():
                want = refs[step][name].flatten()[start : start + got.numel()]
                err = float((got - want).abs().max()) / scale
                assert err < tol, (rank, step, name, err)
