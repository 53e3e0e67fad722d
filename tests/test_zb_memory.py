"""ZB-H1's activation memory, as data: what each stage holds at its forwards, and what a ``W`` keeps.

The bound (``zero_bubble`` module doc): at each ``F`` stage ``s`` of ``zb_h1`` holds at most
1F1B's ``p - s`` microbatches whose ``B`` is pending and at most ``s`` whose ``W`` is pending
(never more than ``p`` in all); a ``W``-pending microbatch keeps exactly its deferring linears'
inputs and output gradients (``W_s``), nothing of its graph. So a stage's peak is
``max of n_B * A_s + n_W * W_s`` over its F's and B's (after a B one more microbatch waits for
W: the peak where ``W_s > A_s``, e.g. under full recompute), which is what the engine measured (issue 27:
p = 4, m = 8, gpt_tiny hidden 128: stage 3 1 * 2.64 + 3 * 2.5625 = 10.33 MiB against 1F1B's
stage 0 4 * 2.03 = 8.13 MiB; ``W_s`` there is exactly the formula below). So the lags are picked
from the bytes (``zero_bubble.zb_h1_lags``): each stage within 1F1B's peak, the longest lag that
is, and the engine's measured peak at most 1F1B's on the benchmark's shapes.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from models import build_model
from models.config import ModelConfig
from parallel3d.deferred_grads import backward_inputs
from parallel3d.param_meta import is_wgrad_deferrable
from parallel3d.parallel_state import ParallelState
from parallel3d.pipeline.activation_bytes import held_bytes, storage_key
from parallel3d.pipeline.backward_split import split_backward
from parallel3d.pipeline.schedules import build_schedule, simulate
from parallel3d.pipeline.zero_bubble import pending_at_forwards, zb_h1_lags
from parallel3d.topology import Topology

_rng = random.Random(27)
SHAPES = sorted({(1, 1), (2, 1), (4, 8), (3, 2)} | {(p, _rng.randint(1, 3 * p)) for p in (2, 3, 4, 5, 8)
                                                    for _ in range(3)})


@pytest.mark.parametrize("p,m", SHAPES)
def test_zb_h1_holds_1f1b_forwards_plus_at_most_stage_w_pending(p, m):
    zb, one = build_schedule("zb_h1", p, m), build_schedule("1f1b", p, m)
    for s in range(p):
        ours, theirs = pending_at_forwards(zb[s]), pending_at_forwards(one[s])
        assert len(ours) == len(theirs) == m
        assert all(n_w == 0 for _, n_w in theirs)
        assert max(n_b for n_b, _ in theirs) == min(p - s, m)  # 1F1B's warm-up depth
        for n_b, n_w in ours:
            # B-pending forwards never exceed 1F1B's on the same stage; W-pending ones trail by at
            # most `s`; together never more than 1F1B's first stage (the paper's count bound)
            assert n_b <= min(p - s, m) and n_w <= min(s, m - 1) and n_b + n_w <= min(p, m), (s, ours)
        if m >= p:  # tight: the peak moment holds both at once
            assert (min(p - s, m), s) in ours, (s, ours)


def _expected_w_bytes(chunk: torch.nn.Module, tokens: int, element_bytes: int) -> int:
    """Bytes a W-pending microbatch-chunk must keep, from shapes: every deferring linear's output
    gradient and its input, an input read by two linears (SwiGLU's gate and up) once."""
    columns = 0
    for name, p in chunk.named_parameters():
        if not (is_wgrad_deferrable(p) and p.dim() == 2):
            continue
        out_features, in_features = p.shape
        columns += out_features + (0 if name.endswith("mlp.up.weight") else in_features)
    return tokens * columns * element_bytes


CASES = [(arch, last, recompute) for arch in ("gpt", "llama") for last in (False, True)
         for recompute in ("none", "selective", "full")]


@pytest.mark.parametrize("arch,last,recompute", CASES)
def test_w_queue_holds_exactly_its_linears_inputs_and_output_grads(arch, last, recompute):
    pstate = ParallelState(Topology())
    cfg = ModelConfig(arch=arch, num_layers=3, hidden_size=32, num_heads=4, vocab_size=40, max_seq_len=16,
                      tie_embeddings=arch == "gpt", use_bias=arch == "gpt", fused_kernels=False,
                      ffn_hidden_size=None if arch == "gpt" else 48)
    torch.manual_seed(0)
    chunk = build_model(cfg, pstate, seed=0, layer_range=(1, 3), pre_process=False, post_process=last,
                        recompute=recompute)
    x = torch.randn(2, 8, 32, requires_grad=True)
    labels = torch.randint(0, 40, (2, 8))
    out = chunk(x, labels if last else None)
    grad = None if last else torch.randn_like(out)
    _, work = split_backward(out, grad, x, pstate.weight_grads, backward_inputs(chunk.parameters()))
    del out, grad  # what survives B now is what the queue keeps
    params = {storage_key(p) for p in chunk.parameters()}
    assert held_bytes(work.held, params) == _expected_w_bytes(chunk, tokens=16, element_bytes=4)
    work.run()


@pytest.mark.parametrize("rank", [1, 2])
def test_engine_peak_counts_the_w_pending_microbatch_a_b_leaves(rank):
    """Full recompute saves only a chunk's input, while W still keeps its linears' inputs and output
    grads: stage s's peak is then right after a steady-state B, with its lag + 1 microbatches waiting
    for W (the engine once recorded its peak after forwards only, and saw the lag's). A W wait tops a
    forward's bytes there, so every lag is 0 (``zb_lags``; with the paper's lags, s + 1 waited)."""
    from parallel3d.config import resolve
    from parallel3d.dryrun import dry_run_rank
    from parallel3d.planning.cli import job_w_lags
    from parallel3d.train import compose_job

    job, _ = compose_job(["model=gpt_tiny", "parallel.pp=4", "parallel.tp=1", "train.precision=fp32",
                          "train.micro_batch_size=1", "train.seq_len=128", "model.max_seq_len=128",
                          "train.global_batch_size=8", "parallel.schedule=zb_h1", "train.recompute=full"])
    rj = resolve(job, world_size=4)
    h, layers = rj.model.hidden_size, rj.model.num_layers // 4
    assert rj.model.arch == "gpt" and rj.model.ffn_hidden_size is None  # fc1: 4h
    # per layer and token: qkv h -> 3h, out h -> h, fc1 h -> 4h, fc2 4h -> h: inputs + output grads = 16h
    w_bytes = layers * 128 * 16 * h * 4
    lags = job_w_lags(rj)
    assert lags == (0, 0, 0, 0)
    measured = dry_run_rank(rj, rank).activation_bytes
    assert (lags[rank] + 1) * w_bytes <= measured < (lags[rank] + 2) * w_bytes, (measured, w_bytes)


def _bytes_at_moments(actions, held: float, waiting: float) -> float:
    """Most bytes one stage's action list holds after any F or B (the engine's record points), counted
    from the list itself: a microbatch holds ``held`` from its F to its B, ``waiting`` from its B to
    its W (1F1B: nothing after its B)."""
    live: dict[int, float] = {}
    peak = 0.0
    for a in actions:
        if a.kind == "F":
            live[a.microbatch] = held
        elif a.kind == "B":
            live[a.microbatch] = waiting if any(x.kind == "W" for x in actions) else 0.0
        elif a.kind == "W":
            live[a.microbatch] = 0.0
        if a.kind in ("F", "B"):
            peak = max(peak, sum(live.values()))
    return peak


LAG_CASES = [(p, m, seed) for p, m in [(2, 8), (3, 4), (4, 8), (4, 3), (5, 12), (8, 16)] for seed in range(4)]


@pytest.mark.parametrize("p,m,seed", LAG_CASES)
def test_zb_h1_lags_stay_within_1f1b_peak_bytes_and_are_the_longest_that_do(p, m, seed):
    """Per-stage bytes drawn around a transformer's (W_s near A_s; a heavier last stage, as the head's
    vocab-wide logits gradient makes it): every stage of zb_h1 built with ``zb_h1_lags`` holds at most
    1F1B's peak (max over its stages), and one more microbatch of lag on any stage would not."""
    rng = random.Random(seed)
    held = [rng.uniform(1.0, 1.2) for _ in range(p)]
    waiting = [a * rng.uniform(0.8, 1.1) for a in held]
    held[-1] *= rng.uniform(1.0, 1.5)
    waiting[-1] *= rng.uniform(1.0, 1.6)
    lags = zb_h1_lags(p, m, held, waiting)
    zb, one = build_schedule("zb_h1", p, m, w_lags=lags), build_schedule("1f1b", p, m)
    budget = max(_bytes_at_moments(one[s], held[s], 0.0) for s in range(p))
    for s in range(p):
        assert 0 <= lags[s] <= s
        assert all(n_b <= min(p - s, m) and n_w <= lags[s] for n_b, n_w in pending_at_forwards(zb[s]))
        shortest = build_schedule("zb_h1", p, m, w_lags=[*lags[:s], 0, *lags[s + 1:]])[s]
        if _bytes_at_moments(shortest, held[s], waiting[s]) > budget:  # a W wait heavier than a forward's
            assert lags[s] == 0  # by more than the slack: no lag fits; the least a split holds
            continue
        assert _bytes_at_moments(zb[s], held[s], waiting[s]) <= budget + 1e-9, (s, lags)
        if lags[s] < s:
            longer = build_schedule("zb_h1", p, m, w_lags=[*lags[:s], lags[s] + 1, *lags[s + 1:]])
            assert _bytes_at_moments(longer[s], held[s], waiting[s]) > budget, (s, lags)


def test_zb_h1_lags_are_the_papers_where_a_w_wait_is_no_heavier_than_a_forward():
    """Equal stages with W_s <= A_s (the paper's assumption): every stage trails by its index, as before."""
    assert zb_h1_lags(4, 8, [2.0] * 4, [1.9] * 4) == (0, 1, 2, 3)
    assert build_schedule("zb_h1", 4, 8, w_lags=(0, 1, 2, 3)) == build_schedule("zb_h1", 4, 8)


def test_w_lags_are_checked():
    with pytest.raises(ValueError):
        build_schedule("zb_h1", 4, 8, w_lags=(0, 1, 2))  # one per stage
    with pytest.raises(ValueError):
        build_schedule("1f1b", 4, 8, w_lags=(0, 0, 0, 0))  # zb_h1 only
    with pytest.raises(ValueError):
        build_schedule("zb_h1", 4, 8, w_lags=(1, 1, 2, 3))  # at most the stage index


@pytest.mark.parametrize("lags", [lags for p in (2, 3, 4) for lags in itertools.product(*map(range, range(1, p + 1)))])
@pytest.mark.parametrize("costs", [(1.0, 1.0, 1.0), (1.0, 1.0, 0.5), (1.0, 1.0, 0.9)])
def test_every_lag_keeps_zb_h1s_bubble_below_1f1bs(lags, costs):
    """A shorter lag gives back part of zb_h1's cool-down filling, never all of it (m = 8; F : B : W at
    the unit and at the split backward's measured ratios, hidden 128 and 256, module doc)."""
    p, (f, b, w) = len(lags), costs
    zb = simulate(build_schedule("zb_h1", p, 8, w_lags=lags), f, b + w, wgrad_time=w).bubble_fraction
    assert zb < simulate(build_schedule("1f1b", p, 8), f, b + w).bubble_fraction


@pytest.mark.parametrize("hidden", [128, 256])
@pytest.mark.parametrize("pp", [2, 4])
def test_zb_h1_measured_peak_is_at_most_1f1bs_on_the_benchmark_shapes(pp, hidden):
    """The engine's measured activation peak (max over ranks, dry run) of zb_h1 with the lags the trainer
    picks (``planning.zb_lags``) against 1F1B's, on ``scripts/bench_pipeline.py``'s model (issue 27:
    with every stage trailing by its index the last stage held 10.33 MiB against 8.13 at pp 4)."""
    from parallel3d.config import resolve
    from parallel3d.dryrun import dry_run_rank
    from parallel3d.train import compose_job

    def peak(schedule: str) -> int:
        job, _ = compose_job(["model=gpt_tiny", f"parallel.pp={pp}", "parallel.tp=1", "train.precision=fp32",
                              f"model.hidden_size={hidden}", "model.num_heads=4", "model.vocab_size=1024",
                              "model.num_layers=8", "train.micro_batch_size=2", "train.seq_len=64",
                              "model.max_seq_len=64", "train.global_batch_size=16", f"parallel.schedule={schedule}"])
        rj = resolve(job, world_size=pp)
        reports = [dry_run_rank(rj, r) for r in range(pp)]
        assert not [r.error for r in reports if r.error]
        return max(r.activation_bytes for r in reports)

    assert peak("zb_h1") <= peak("1f1b")
