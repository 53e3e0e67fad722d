"""The gradient hook's lean path (``grad_sync.GradSync._hook``, run once per parameter per backward in
Python): in the zero-copy case it writes each gradient once per step (the first after ``zero_grad``) and
later microbatches accumulate in place with no call, and the hook itself turns grad mode off only
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


def test_zero_copy_hook_writes_each_gradient_once_then_accumulates_in_place(monkeypatch):
    """After ``zero_grad`` (``.grad`` None) the first backward's hook writes each gradient into its view
    (one call per parameter); a later microbatch's gradient is added there by autograd itself (no call)."""
    model, reference = _pair()
    opt = _optimizer(model, 0)
    params = list(model.parameters())
    calls = []
    original = ReplicatedGradSync._write
    monkeypatch.setattr(ReplicatedGradSync, "_write", lambda self, *a: (calls.append(a[-2]), original(self, *a)))
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    for _ in range(2):  # the second step starts from zero_grad's unbound .grads
        opt.grad_sync.prepare(False)
        model(x).pow(2).sum().backward()
        assert sorted(map(id, calls)) == sorted(map(id, params)), "one write per parameter in the first backward"
        calls.clear()
        opt.grad_sync.prepare(True)
        model(y).pow(2).sum().backward()
        opt.grad_sync.finalize()
        assert not calls, f"{len(calls)} hook writes in a backward accumulating into bound views"
        reference.zero_grad()
        reference(x).pow(2).sum().backward()
        reference(y).pow(2).sum().backward()
        for p, r in zip(params, reference.parameters()):
            assert p.grad is opt.grad_sync.main_grad(p)
            assert torch.equal(p.grad, r.grad)
        opt.grad_sync.zero_grad()
        assert all(p.grad is None for p in params)
    # a .grad replaced by another tensor is still written (copied into its view)
    opt.grad_sync.prepare(False)
    model(x).pow(2).sum().backward()
    calls.clear()
    first = params[0]
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
