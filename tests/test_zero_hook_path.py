"""The gradient hook's lean path (``grad_sync.GradSync._hook``, run once per parameter per backward in
Python): the zero-copy common case does no absorbing call, and the hook itself turns grad mode off only
when backward runs with ``create_graph=True``, so no gradient buffer ever joins the autograd graph.
Gradients are checked against a plain model's (the same arithmetic: exact)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from parallel3d.parallel_state import ParallelState
from parallel3d.topology import Topology
from parallel3d.zero import ZeroOptimizer
from parallel3d.zero.grad_replicated import ReplicatedGradSync


def _pair() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4), nn.LayerNorm(4))
    return model, copy.deepcopy(model)


def _optimizer(model: nn.Module, stage: int) -> ZeroOptimizer:
    return ZeroOptimizer([model], ParallelState(Topology(tp=1, pp=1, dp=1)), zero_stage=stage, lr=1e-3,
                         clip_grad=None, overlap_param_gather=False, bucket_size_mb=40 * 4 / 2**20)


def test_zero_copy_backward_never_calls_absorb(monkeypatch):
    model, reference = _pair()
    opt = _optimizer(model, 0)
    calls = []
    original = ReplicatedGradSync._absorb
    monkeypatch.setattr(ReplicatedGradSync, "_absorb", lambda self, *a: (calls.append(a[-1]), original(self, *a)))
    x = torch.randn(3, 8)
    for _ in range(2):  # the second step starts from zero_grad's rebound views
        model(x).pow(2).sum().backward()
        opt.grad_sync.finalize()
        assert not calls, f"{len(calls)} absorbing calls in a zero-copy backward"
        reference.zero_grad()
        reference(x).pow(2).sum().backward()
        for p, r in zip(model.parameters(), reference.parameters()):
            assert torch.equal(opt.grad_sync.main_grad(p), r.grad)
        opt.grad_sync.zero_grad()
    # a .grad replaced by another tensor is still absorbed (copied into its view)
    first = next(model.parameters())
    first.grad = torch.ones_like(first)
    model(x).pow(2).sum().backward()
    assert calls == [first]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_create_graph_backward_keeps_gradient_storage_out_of_the_graph(stage):
    model, reference = _pair()
    opt = _optimizer(model, stage)
    x = torch.randn(3, 8)
    model(x).pow(2).sum().backward(create_graph=True)
    opt.grad_sync.finalize()
    reference(x).pow(2).sum().backward()
    storage = opt.grad_sync.gradient_tensors() + opt.grad_sync.staging_buffers()
    assert not any(t.requires_grad for t in storage)
    layout = opt.layouts[0]
    for b in layout.buckets:
        piece = opt.grad_sync.grad_piece(0, b)
        for seg in b.segments:
            lo = seg.shard_start - b.shard_offset
            want = dict(zip(model.parameters(), reference.parameters()))[seg.slot.param].grad.reshape(-1)
            assert torch.equal(piece[lo : lo + seg.length], want[seg.param_start : seg.param_start + seg.length])


def test_grad_replaced_after_its_bucket_launched_raises_at_finalize():
    model, _ = _pair()
    opt = _optimizer(model, 0)
    model(torch.randn(3, 8)).pow(2).sum().backward()  # every bucket launched from the hooks
    first = next(model.parameters())
    first.grad = torch.zeros_like(first)
    with pytest.raises(RuntimeError, match="replaced after its bucket's reduction started"):
        opt.grad_sync.finalize()
