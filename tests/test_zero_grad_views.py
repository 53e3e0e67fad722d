"""Stage 0's ``zero_grad`` (``grad_replicated``): every ``.grad`` is bound again to its view of the zeroed
gradient buffer, whatever the caller did to it (a ``.grad`` set to another tensor is absorbed: its value
is copied into the view), so the next backward accumulates in place (no copy)."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from parallel3d.parallel_state import ParallelState
from parallel3d.topology import Topology
from parallel3d.zero import ZeroOptimizer


def test_zero_grad_rebinds_each_grad_to_its_zeroed_bucket_view():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4))
    reference = copy.deepcopy(model)
    opt = ZeroOptimizer([model], ParallelState(Topology(tp=1, pp=1, dp=1)), zero_stage=0, lr=1e-3, clip_grad=None)
    x = torch.randn(2, 8)
    model(x).sum().backward()
    params = list(model.parameters())
    params[0].grad = None  # dropped by the caller
    params[1].grad = torch.full_like(params[1], 3.0)  # replaced by another tensor
    opt.zero_grad()
    for i, p in enumerate(params):
        main = opt.grad_sync.main_grad(p)
        assert p.grad is not None and p.grad.data_ptr() == main.data_ptr() and p.grad.shape == p.shape
        assert torch.equal(p.grad, torch.full_like(p, 3.0) if i == 1 else torch.zeros_like(p))
    params[1].grad.zero_()
    model(x).sum().backward()  # accumulates into the views: the gradients of a plain model, in the buffer
    reference(x).sum().backward()
    for p, r in zip(params, reference.parameters()):
        assert p.grad.data_ptr() == opt.grad_sync.main_grad(p).data_ptr()
        assert torch.equal(p.grad, r.grad)
