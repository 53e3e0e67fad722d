"""Bytes held and bytes sent per rank are measured and compared with the ZeRO paper's formulas."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from parallel3d.parallel_state import ParallelState
from parallel3d.topology import Topology
from parallel3d.zero import MEMORY_CATEGORIES, ZeroOptimizer
from parallel3d.zero.grad_sync import MAX_STAGING_BUFFERS
from tests.harness import run_on_ranks

BUCKET_ELEMS = 16411  # odd and above the largest parameter (16256), so staging buffers are <= one bucket


def make_model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(61, 127), nn.Tanh(), nn.Linear(127, 127), nn.LayerNorm(127), nn.Linear(127, 63)).to(dtype)


def param_count() -> int:
    return sum(p.numel() for p in make_model(torch.float32).parameters())


def expected_bytes(stage: int, precision: str, n: int, psi: int, bucket_bytes: int) -> dict[str, float]:
    """Bytes per rank from the ZeRO paper's accounting (fp32: parameters are the master weights)."""
    w = 4 if precision == "fp32" else 2
    master = 0 if precision == "fp32" else 4
    shard = 1 if stage == 0 else n
    return {
        "model_weights": w * psi,
        "gradients": w * psi / (n if stage == 2 else 1),
        "master_weights": master * psi / shard,
        "optimizer_moments": 8 * psi / shard,
        "buckets": MAX_STAGING_BUFFERS * bucket_bytes if stage == 2 else 0,
    }


def _measure(rank, world_size, precision, reduce_scatter="reduce_scatter"):
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    ps = ParallelState(Topology(1, 1, world_size))
    out = {}
    for stage in (0, 1, 2):
        model = make_model(dtype)
        esize = torch.finfo(dtype).bits // 8
        opt = ZeroOptimizer([model], ps, zero_stage=stage, lr=1e-3, precision=precision,
                            bucket_size_mb=BUCKET_ELEMS * esize / 2**20, reduce_scatter=reduce_scatter)
        for step in range(2):
            ps.comm_stats.reset()
            x = torch.randn(4, 61, dtype=dtype)
            model(x).float().pow(2).mean().backward()
            calls_during_backward = sum(ps.comm_stats.calls.get(("dp", op), 0) for op in ("reduce_scatter", "all_reduce"))
            live_grads = sum(p.grad is not None for p in model.parameters())
            mem_after_backward = opt.memory_bytes()
            opt.step()
            stats = dict(ps.comm_stats.bytes)
            opt.zero_grad()
        out[stage] = dict(mem=mem_after_backward, mem_after_step=opt.memory_bytes(), comm=stats,
                          rs_in_backward=calls_during_backward, buckets=len(opt.layouts[0].buckets),
                          live_grads=live_grads, padded=opt.layouts[0].numel, esize=esize)
    return out


@pytest.mark.parametrize("precision,dp", [("bf16", 4), ("fp32", 2)])
def test_measured_memory_matches_formula(precision, dp):
    psi = param_count()
    results = run_on_ranks(_measure, dp, precision, timeout=120)
    for rank, per_stage in enumerate(results):
        for stage, r in per_stage.items():
            bucket_bytes = BUCKET_ELEMS * r["esize"]
            want = expected_bytes(stage, precision, dp, psi, bucket_bytes)
            assert set(r["mem"]) == set(MEMORY_CATEGORIES)
            got_total, want_total = sum(r["mem"].values()), sum(want.values())
            assert abs(got_total - want_total) <= 0.05 * want_total, (stage, r["mem"], want)
            for key in MEMORY_CATEGORIES:
                assert r["mem"][key] == pytest.approx(want[key], rel=0.05, abs=64), (stage, key, r["mem"], want)
            if stage == 2:
                # No full gradient outlives its bucket; reductions started inside backward.
                assert r["live_grads"] == 0
                assert r["rs_in_backward"] == r["buckets"] > 1


@pytest.mark.parametrize("dp", [2, 4])
def test_communication_bytes_equal_ddp(dp):
    results = run_on_ranks(_measure, dp, "fp32", timeout=120)
    psi = param_count()
    for per_stage in results:
        ddp = per_stage[0]["comm"][("dp", "all_reduce")]  # stage 0 is DDP: all-reduce of every gradient
        padded = per_stage[0]["padded"]
        assert ddp == int(2 * padded * 4 * (dp - 1) / dp)
        assert padded - psi < dp * per_stage[0]["buckets"]  # padding: < dp elements per bucket
        for stage in (1, 2):
            comm = per_stage[stage]["comm"]
            assert comm[("dp", "reduce_scatter")] + comm[("dp", "all_gather")] == pytest.approx(ddp, abs=2)
            # Everything else on the dp group is the grad-norm scalar.
            rest = sum(v for (kind, op), v in comm.items() if kind == "dp" and op == "all_reduce")
            assert rest <= 8


def test_gloo_reduce_scatter_as_all_reduce_counts_what_it_sends():
    """The gloo mode ("auto" on gloo) replaces each bucket's reduce-scatter by an all-reduce
    (twice the bytes, counted as such), still launched inside stage 2's backward."""
    dp = 2
    modes = run_on_ranks(_measure_both_modes, dp, timeout=120)
    for rs_mode, ar_mode in modes:
        ddp = rs_mode[0]["comm"][("dp", "all_reduce")]
        for stage in (1, 2):
            rs, ar = rs_mode[stage]["comm"], ar_mode[stage]["comm"]
            assert ("dp", "reduce_scatter") not in ar
            assert ar[("dp", "all_gather")] == rs[("dp", "all_gather")]
            norm_bytes = rs[("dp", "all_reduce")]  # the grad-norm scalar: the only all-reduce of rs mode
            assert ar[("dp", "all_reduce")] - norm_bytes == ddp  # every bucket all-reduced once, as in stage 0
        assert ar_mode[2]["rs_in_backward"] == ar_mode[2]["buckets"] > 1
        assert ar_mode[2]["live_grads"] == 0


def _measure_both_modes(rank, world_size):
    return _measure(rank, world_size, "fp32", "reduce_scatter"), _measure(rank, world_size, "fp32", "all_reduce")
