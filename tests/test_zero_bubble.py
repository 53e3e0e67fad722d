"""Zero-bubble schedules (zb_h1) and the split backward they run (B: input grad, W: weight grads).

Schedules: generated (p, m) shapes; validation, NCCL batch semantics, memory bound, and the
simulated bubble against the closed form. Split backward: random small networks against one
unsplit ``backward``. Executor: toy pipelines at pp=2,3,4 against a float64 single process
(the real Trainer is covered by ``tests/layout_matrix.py``, which draws ``zb_h1`` from
``config.SCHEDULES``).
"""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from models.config import ModelConfig
from parallel3d.parallel_state import ParallelState
from parallel3d.pipeline import backward_split
from parallel3d.pipeline.backward_split import input_grad
from parallel3d.pipeline.engine import PipelineEngine
from parallel3d.pipeline.partition import partition_layers, stage_layer_ranges
from parallel3d.pipeline.schedules import (
    Action,
    ScheduleError,
    build_schedule,
    check_coalesced_progress,
    format_schedule,
    format_timeline,
    peak_in_flight,
    simulate,
    validate_schedule,
)
from parallel3d.topology import Topology
from tests.harness import run_on_ranks
from tests.pipeline_toy import HIDDEN, ToyModel, toy_batch
from tests.test_pipeline_engine import MBS, SEQ, RecordingGradSync, _check_against_reference, _run_cases

_rng = random.Random(16)
SHAPES = sorted({(1, 3), (2, 1)} | {(p, _rng.randint(1, 3 * p)) for p in (2, 3, 4, 5, 8) for _ in range(3)})


@pytest.mark.parametrize("p,m", SHAPES)
def test_zb_h1_valid_memory_bounded_and_nccl_safe(p, m):
    for coalesced in (False, True):
        schedule = build_schedule("zb_h1", p, m, coalesced_p2p=coalesced)
        for stage, actions in schedule.items():
            for kind in ("F", "B", "W"):
                assert sorted(a.microbatch for a in actions if a.kind == kind) == list(range(m)), (stage, kind)
            pos = {(a.kind, a.microbatch): i for i, a in enumerate(actions)}
            assert all(pos[("B", i)] < pos[("W", i)] for i in range(m))
            assert not any(a.kind not in ("F", "B", "W") and a.kind.endswith("W") for a in actions)
        assert max(peak_in_flight(schedule).values()) <= min(p, m)  # 1F1B's peak: its first stage's
        check_coalesced_progress(schedule, prefetch=0, coalesced=True)
        check_coalesced_progress(schedule, prefetch=2, coalesced=False)


@pytest.mark.parametrize("p,m", [s for s in SHAPES if s[0] > 1])
def test_zb_h1_bubble_against_closed_form_and_1f1b(p, m):
    """F = B = W = 1 (a whole backward 2): zb_h1's bubble is (p-1)/(3m+p-1) once m >= p, under half of 1F1B's."""
    zb = simulate(build_schedule("zb_h1", p, m), 1.0, 2.0).bubble_fraction
    one = simulate(build_schedule("1f1b", p, m), 1.0, 2.0).bubble_fraction
    assert one == pytest.approx(3 * (p - 1) / (3 * m + 3 * (p - 1)))
    assert zb < one
    if m >= p:
        assert zb == pytest.approx((p - 1) / (3 * m + p - 1))
        assert zb <= 0.5 * one


def test_issue_target_p4_m8_and_printer_shows_w():
    zb, one = build_schedule("zb_h1", 4, 8), build_schedule("1f1b", 4, 8)
    assert simulate(zb, 1.0, 2.0).bubble_fraction <= 0.5 * simulate(one, 1.0, 2.0).bubble_fraction
    assert "W" in format_timeline(simulate(zb, 1.0, 2.0)) and " W0" in format_schedule(zb)
    # W's cost is taken from wgrad_time; B gets the rest of the backward.
    t = simulate(zb, 1.0, 3.0, wgrad_time=2.0)
    b = [x for x in t.actions if x.stage == 0 and x.action.kind == "B"][0]
    w = [x for x in t.actions if x.stage == 0 and x.action.kind == "W"][0]
    assert (b.end - b.start, w.end - w.start) == (1.0, 2.0)


def test_validator_rejects_w_before_b_and_missing_w():
    schedule = build_schedule("zb_h1", 2, 2)
    acts = schedule[1]
    i, j = acts.index(Action("B", 0)), acts.index(Action("W", 0))
    swapped = list(acts)
    swapped[i], swapped[j] = swapped[j], swapped[i]
    with pytest.raises(ScheduleError, match="W\\) before"):
        validate_schedule({0: schedule[0], 1: swapped})
    with pytest.raises(ScheduleError, match="no W for microbatches \\[1\\]"):
        validate_schedule({0: schedule[0], 1: [a for a in acts if a != Action("W", 1)]})


# ---- the split backward -------------------------------------------------------------------
class _Net(torch.nn.Module):
    """Residual MLP blocks; optional recompute and a weight used at every block (no exact split)."""

    def __init__(self, rng: random.Random, recompute: bool, shared: bool) -> None:
        super().__init__()
        h = rng.choice((4, 8))
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(h), torch.nn.Linear(h, 2 * h, bias=rng.random() < 0.5),
                                torch.nn.GELU(), torch.nn.Linear(2 * h, h))
            for _ in range(rng.randint(1, 3)))
        self.scale = torch.nn.Parameter(torch.randn(h)) if shared else None
        self.recompute, self.hidden = recompute, h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + (checkpoint(block, x, use_reentrant=False) if self.recompute else block(x))
            if self.scale is not None:
                x = x * self.scale
        return x


@pytest.mark.parametrize("seed", range(6))
def test_split_backward_equals_one_backward(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    net = _Net(rng, recompute=seed % 2 == 1, shared=seed % 3 == 2).double()
    x = torch.randn(2, 3, net.hidden, dtype=torch.float64)
    g = torch.randn_like(x)
    ref_in = x.clone().requires_grad_()
    net(ref_in).backward(g)
    ref = {n: p.grad.clone() for n, p in net.named_parameters()}
    net.zero_grad(set_to_none=True)
    fired: list[str] = []
    names = {id(p): n for n, p in net.named_parameters()}
    for p in net.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(names[id(p)]))
    inp = x.clone().requires_grad_()
    g_in, weight = input_grad(net(inp), g, inp)
    torch.testing.assert_close(g_in, ref_in.grad)
    if net.scale is None:  # an exact split: B leaves every weight gradient to W
        assert fired == [] and all(p.grad is None for p in net.parameters())
    weight.run()
    assert sorted(fired) == sorted(ref)  # each parameter's hook fired exactly once
    for n, p in net.named_parameters():
        torch.testing.assert_close(p.grad, ref[n])


@pytest.mark.parametrize("seed", range(4))
def test_w_computes_matmul_and_bias_grads_without_graph_walks(seed, monkeypatch):
    """Under identity saved-tensor hooks (the engine's), ``W`` of Linear/bias layers calls no
    ``autograd.grad`` (direct formulas) and leaves bitwise the grads of one ``backward``."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(rng.choice((3, 5)), 6, bias=rng.random() < 0.5)]
    for _ in range(rng.randint(1, 3)):
        layers += [torch.nn.Tanh(), torch.nn.Linear(6, 6, bias=rng.random() < 0.5)]
    net = torch.nn.Sequential(*layers)
    shape = (rng.randint(1, 3), 4, layers[0].in_features)[-rng.choice((2, 3)):]  # 2-D (addmm) or 3-D (mm)
    x, bias = torch.randn(*shape), torch.randn(6, requires_grad=True)  # plus a broadcast bias add

    def forward(inp):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, backward_split.plain_unpack):
            return net(inp) + bias

    g = torch.randn(*shape[:-1], 6)
    ref_in = x.clone().requires_grad_()
    forward(ref_in).backward(g)
    params = [*net.parameters(), bias]
    ref = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    inp = x.clone().requires_grad_()
    g_in, weight = input_grad(forward(inp), g, inp)
    calls = []
    real_grad = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: calls.append(1) or real_grad(*a, **k))
    weight.run()
    assert calls == []
    assert torch.equal(g_in, ref_in.grad)
    for p, want in zip(params, ref):
        assert torch.equal(p.grad, want)


# ---- the executor ---------------------------------------------------------------------------
def _zb_cases(pp: int) -> list[tuple]:
    """(pp, schedule, m, v, num_layers, pp_layers, tied, emulate_nccl): m below, at, above pp."""
    rng = random.Random(pp)
    ms = [max(1, pp - 1), pp, 2 * pp + 1]
    return [(pp, "zb_h1", m, 1, pp + rng.randint(0, 2), None, i % 2 == 0, i > 0) for i, m in enumerate(ms)]


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_zb_h1_pipeline_grads_match_single_process(pp):
    cases = _zb_cases(pp)
    _check_against_reference(cases, run_on_ranks(_run_cases, pp, cases, timeout=120))


def _zb_grad_sync_case(rank, world):
    pstate = ParallelState(Topology(tp=1, pp=world, dp=1))
    cfg = ModelConfig(num_layers=4, hidden_size=HIDDEN, num_heads=1, vocab_size=32)
    (r,) = stage_layer_ranges(partition_layers(cfg, world, 1), world, pstate.coord("pp"))
    chunk = ToyModel(4, r)
    sync = RecordingGradSync()
    for p in chunk.parameters():  # where gradients arrive, relative to the engine's calls
        p.register_post_accumulate_grad_hook(lambda p: sync.calls.append(("grad",)))
    engine = PipelineEngine([chunk], pstate, schedule="zb_h1", num_microbatches=5, micro_batch_size=MBS,
                            seq_len=SEQ, hidden_size=HIDDEN, grad_sync=sync)
    engine.run_step(toy_batch(5, MBS, SEQ))
    halves = [(a.kind, a.microbatch) for a in engine.actions if a.kind in ("B", "W")]
    return sync.calls, halves, len(list(chunk.parameters()))


def test_zb_h1_grads_arrive_in_w_and_sync_flags_follow_the_last_w():
    for calls, halves, nparams in run_on_ranks(_zb_grad_sync_case, 2):
        assert calls[-1] == ("finalize",)  # once per step, after the last W
        prepares = [i for i, c in enumerate(calls) if c[0] == "prepare"]
        assert len(prepares) == len(halves)
        last_w = max(i for i, h in enumerate(halves) if h[0] == "W")
        assert [k for k, i in enumerate(prepares) if calls[i][1]] == sorted([last_w, halves.index(("B", halves[last_w][1]))])
        for k, i in enumerate(prepares):  # gradients arrive only after a W's prepare, nparams of them
            end = prepares[k + 1] if k + 1 < len(prepares) else len(calls) - 1
            grads = sum(1 for c in calls[i + 1:end] if c == ("grad",))
            assert grads == (nparams if halves[k][0] == "W" else 0), (halves[k], grads)


def test_split_backward_frees_each_graph_under_the_engines_saved_tensor_hooks():
    """B keeps the graph for W and W runs only off the input path, so nothing releases the input
    path's saved tensors: the graph must go by reference counting alone. The engine's pack hook
    once returned saved outputs as themselves (tensor -> grad_fn -> saved tensor: a cycle), and
    zb_h1 kept every microbatch's activations for the whole run."""
    import weakref

    from parallel3d.pipeline.engine import _SavedBytes
    from parallel3d.pipeline.p2p import _storage_users

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Sigmoid(),
                              torch.nn.Linear(8, 1))
    kept: list[weakref.ref] = []
    for layer in (net[1], net[3]):  # tanh and sigmoid save their own outputs
        layer.register_forward_hook(lambda m, i, o: kept.append(weakref.ref(o)))
    received = torch.randn(4, 8)
    alone = _storage_users(received)
    x = received.detach().requires_grad_(True)
    saved = _SavedBytes(set())
    with saved.recording():
        out = net(x).sum()
    assert saved.total > 0
    g, work = input_grad(out, None, x)
    del out, x, g
    work.run()
    del work
    assert all(ref() is None for ref in kept), "a split backward's activations outlived it"
    assert _storage_users(received) == alone
