"""Block planning, the log-sum-exp merge and the single-rank compute paths of CP attention.

The plan is checked against a brute-force mask on generated segment layouts and documents:
every visible (query, key) pair lies in exactly one computed block, a skipped block hides
all its pairs, and a block computed without a causal / document mask needs none.
"""

from __future__ import annotations

import random

import pytest
import torch

from kernels.attention_math import attention_forward_math, attention_reference, block_mask
from parallel3d.context_parallel import AttentionStats, CPGroup, document_ids, local_attention
from parallel3d.context_parallel.block_compute import merge_partial
from parallel3d.context_parallel.blocks import plan_blocks
from parallel3d.context_parallel.segments import Segment, split_segments
from parallel3d.parallel_state import ParallelState


def _random_layout(rng: random.Random, s: int) -> list[Segment]:
    """The positions 0..s-1 cut at random places, the pieces shuffled (any local layout)."""
    cuts = sorted(rng.sample(range(1, s), rng.randint(0, min(5, s - 1))))
    bounds = [0, *cuts, s]
    segments = [Segment(a, b - a) for a, b in zip(bounds, bounds[1:])]
    rng.shuffle(segments)
    return segments


@pytest.mark.parametrize("seed", range(12))
def test_plan_covers_every_visible_pair_once_and_skips_only_hidden_blocks(seed: int) -> None:
    rng = random.Random(seed)
    s, b = rng.randint(2, 24), rng.randint(1, 3)
    tokens = torch.randint(0, 4, (b, s), generator=torch.Generator().manual_seed(seed))
    docs = document_ids(tokens, 0) if seed % 3 else None
    q_segments, k_segments = _random_layout(rng, s), _random_layout(rng, s)
    plan = plan_blocks(q_segments, k_segments, docs)
    visible = block_mask(s, s, causal=True, q_doc=docs, k_doc=docs).expand(b, s, s)
    covered = torch.zeros(s, s, dtype=torch.int64)
    for blk in plan.blocks:
        qs, ks = slice(blk.q.start, blk.q.end), slice(blk.k.start, blk.k.end)
        covered[qs, ks] += 1
        inside = visible[:, qs, ks]
        assert inside.any()  # never computes a block the masks hide entirely
        causal_only = block_mask(blk.q.length, blk.k.length, q_start=blk.q.start, k_start=blk.k.start, causal=True)
        assert blk.causal or bool(causal_only.all())
        if docs is not None and not blk.documents:
            assert bool((docs[:, qs, None] == docs[:, None, ks]).all())
    for skipped in plan.skipped:
        assert not visible[:, skipped.q.start:skipped.q.end, skipped.k.start:skipped.k.end].any()
        covered[skipped.q.start:skipped.q.end, skipped.k.start:skipped.k.end] += 1
    assert bool((covered == 1).all())  # computed and skipped blocks tile the whole score matrix once
    assert len(plan.blocks) + len(plan.skipped) == len(q_segments) * len(k_segments)


@pytest.mark.parametrize("seed", range(4))
def test_merge_through_the_log_sum_exp_equals_attention_over_all_keys(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(2, 4, 5, 8, generator=g), torch.randn(2, 2, 11, 8, generator=g), torch.randn(2, 2, 11, 8, generator=g)
    allowed = torch.rand(2, 5, 11, generator=g) < 0.6
    allowed[:, 0] = False  # a query that sees no key at all stays 0 / -inf
    whole_out, whole_lse = attention_forward_math(q, k, v, scale=0.3, allowed=allowed)
    acc_out, acc_lse = torch.zeros(2, 4, 5, 8), torch.full((2, 4, 5), float("-inf"))
    cuts = [0, 3, 4, 11]
    for a, b in random.Random(seed).sample(list(zip(cuts, cuts[1:])), 3):  # any order
        out, lse = attention_forward_math(q, k[:, :, a:b], v[:, :, a:b], scale=0.3, allowed=allowed[:, :, a:b])
        merge_partial(acc_out, acc_lse, out, lse)
    assert torch.allclose(acc_out, whole_out, atol=1e-6) and torch.equal(torch.isinf(acc_lse), torch.isinf(whole_lse))
    assert torch.allclose(acc_lse[torch.isfinite(whole_lse)], whole_lse[torch.isfinite(whole_lse)], atol=1e-6)
    assert bool((acc_out[:, :, 0] == 0).all())


@pytest.mark.parametrize("backend", ["math", "torch"])
@pytest.mark.parametrize("with_documents", [False, True])
def test_single_rank_paths_match_torch_attention(backend: str, with_documents: bool) -> None:
    g = torch.Generator().manual_seed(7)
    b, s, hq, hk, d = 2, 20, 6, 2, 8
    q, k, v = (torch.randn(b, s, h, d, generator=g, requires_grad=True) for h in (hq, hk, hk))
    docs = document_ids(torch.randint(0, 5, (b, s), generator=g), 0) if with_documents else None
    stats = AttentionStats()
    out = local_attention(q, k, v, document_ids=docs, backend=backend, stats=stats)
    dout = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = attention_reference(*leaves, document_ids=docs)
    ref_grads = torch.autograd.grad(ref, leaves, dout.double())
    for got, want in zip((out, *grads), (ref, *ref_grads)):
        assert (got.double() - want).abs().max() / want.abs().max() < 1e-5
    assert len(stats.blocks("backward")) == len(stats.blocks("forward")) == (
        3 - stats.skipped_count("documents") if with_documents else 1)  # 2 chunks with documents: one hidden causally


def test_split_segments_keeps_order_and_tokens() -> None:
    segments = [Segment(10, 5), Segment(0, 3)]
    assert split_segments(segments, 2) == [Segment(10, 2), Segment(12, 2), Segment(14, 1), Segment(0, 2), Segment(2, 1)]


@pytest.mark.parametrize("backend", ["math", "torch"])
def test_bf16_inputs_keep_fp32_statistics(backend: str) -> None:
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 16, h, 8, generator=g).bfloat16().requires_grad_() for h in (4, 2, 2))
    docs = document_ids(torch.randint(0, 4, (1, 16), generator=g), 0)
    out = local_attention(q, k, v, document_ids=docs, backend=backend)
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = attention_reference(*leaves, document_ids=docs)
    ref_grads = torch.autograd.grad(ref.square().sum(), leaves)
    assert out.dtype == torch.bfloat16 and all(x.dtype == torch.bfloat16 for x in grads)
    for got, want in zip((out, *grads), (ref, *ref_grads)):
        assert (got.double() - want).abs().max() / want.abs().max() < 2e-2


def test_cp_group_from_a_parallel_state_takes_its_counters_and_nccl_emulation() -> None:
    pstate = ParallelState.single_process()
    group = CPGroup.from_pstate(pstate, "tp")
    assert group.size == 1 and group.stats is pstate.comm_stats and group.p2p_streams is pstate.emulated_p2p_streams
    out = torch.empty(3)
    group.all_gather(out, torch.arange(3.0)).wait()  # size 1: a local copy, nothing counted
    assert torch.equal(out, torch.arange(3.0)) and pstate.comm_stats.total() == 0


def test_scheduling_point_runs_once_per_block_and_changes_no_number() -> None:
    """The ring's hook between blocks (``os.sched_yield`` on CPU while a transfer is in flight):
    called after every computed block, forward and backward, and the results are bitwise those
    of the same call without it."""
    from kernels.attention_math import default_scale
    from parallel3d.context_parallel.block_compute import BlockAttention
    from parallel3d.context_parallel.blockwise import (
        attend, attend_backward, backward_inputs, finish_output, heads_first, output_accumulators,
    )

    g = torch.Generator().manual_seed(7)
    s, segments = 12, [Segment(6, 6), Segment(0, 6)]
    q, k, v, dout = (torch.randn(1, s, h, 8, generator=g) for h in (4, 2, 2, 4))
    engine = BlockAttention("math", default_scale(8))
    plan = plan_blocks(segments, segments, None)
    assert len(plan.blocks) > 1
    results = []
    for hook in (None, "count"):
        calls = []
        point = (lambda: calls.append(1)) if hook else None
        acc_out, acc_lse = output_accumulators(q)
        attend(engine, heads_first(q), heads_first(k), heads_first(v), plan, acc_out, acc_lse, set(), point)
        out = finish_output(acc_out, q.dtype)
        qh, outh, doh, delta, dq = backward_inputs(q, out, dout)
        dk, dv = torch.zeros_like(heads_first(k)), torch.zeros_like(heads_first(v))
        attend_backward(engine, doh, qh, heads_first(k), heads_first(v), outh, acc_lse, delta, plan, dq, dk, dv, point)
        results.append((out, dq, dk, dv))
        if hook:
            assert len(calls) == 2 * len(plan.blocks)
    for a, b in zip(*results):
        assert torch.equal(a, b)
