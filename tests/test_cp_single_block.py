"""``cp_comm=a2a`` without documents: one fused kernel call each way (``single_block``), exact.

After the all-to-all a rank holds the whole (position-ordered) sequence for its heads, so the
plan is one causal block that torch's CPU flash kernels compute whole. On 2 gloo ranks, with
grouped kv heads fewer than cp (repeated for the all-to-all), more than cp (read grouped by
the kernel) and equal, each rank's load-balanced share of the output and of dq / dk / dv must
equal torch's float64 whole-sequence attention, and the aten ops the call runs (counted by a
dispatch mode, nothing replaced) must be one flash forward, one flash backward and none of the
general path's extra passes: no zero / -inf fills, no in-place adds into accumulators, no kv
repeat for the kernel, no ``rowsum(dout * out)``.
"""

from __future__ import annotations

import torch

from parallel3d.context_parallel import AttentionStats, context_parallel_attention, split_for_cp
from tests.cp_cases import AttnCase, Groups, case_tensors, reference, rel_err
from tests.harness import run_on_ranks
from tests.op_count import OpCount

# The general blockwise path's extra passes around the one kernel call (see single_block's doc).
EXTRA_PASSES = ("aten.zero_", "aten.zeros", "aten.fill_", "aten.full", "aten.add_", "aten.mul",
                "aten.repeat_interleave", "aten.index_select", "aten.logaddexp")
FLASH = "aten._scaled_dot_product_flash_attention_for_cpu"


def _a2a(rank: int, world: int, cases: list[AttnCase]) -> list[dict]:
    groups = Groups(rank, world, emulate_nccl=False)
    results = []
    for case in cases:
        t = case_tensors(case, world)
        out_ref, grads_ref = reference(t)
        local = [split_for_cp(t[n], world, rank).float().requires_grad_() for n in ("q", "k", "v")]
        stats = AttentionStats()
        counter = OpCount()
        with counter:
            out = context_parallel_attention(*local, cp_comm="a2a", cp_group=groups.cp, backend="torch", stats=stats)
            grads = torch.autograd.grad(out, local, split_for_cp(t["dout"], world, rank).float())
        errors = {"out": rel_err(out, split_for_cp(out_ref, world, rank), out_ref)}
        for name, got, want in zip(("dq", "dk", "dv"), grads, grads_ref):
            errors[name] = rel_err(got, split_for_cp(want, world, rank), want)
        results.append({"errors": errors, "ops": dict(counter.ops),
                        "blocks": (len(stats.blocks("forward")), len(stats.blocks("backward")))})
    return results


def test_a2a_is_one_fused_call_each_way_and_exact() -> None:
    cases = [AttnCase(seed=11, batch=2, chunk=5, q_heads=4, kv_heads=1, head_dim=8, documents=False),  # kv < cp
             AttnCase(seed=12, batch=1, chunk=3, q_heads=8, kv_heads=4, head_dim=6, documents=False),  # kv > cp
             AttnCase(seed=13, batch=1, chunk=4, q_heads=6, kv_heads=2, head_dim=8, documents=False)]  # kv = cp
    for rank, results in enumerate(run_on_ranks(_a2a, 2, cases, timeout=120)):
        for case, r in zip(cases, results):
            assert max(r["errors"].values()) < 1e-5, (case, rank, r["errors"])
            assert r["blocks"] == (1, 1), (case, rank)
            ops = r["ops"]
            assert ops.get(FLASH) == 1 and ops.get(FLASH + "_backward") == 1, (case, rank, ops)
            assert not [op for op in EXTRA_PASSES if ops.get(op)], (case, rank, ops)
