"""``scripts/profile_w_lag.py`` compares like with like: a step of B + W with ``W`` lagging L microbatches
leaves bitwise the gradients of 1F1B's step (one full backward per microbatch), for every lag it times."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from profile_split_backward import _setup  # noqa: E402
from profile_w_lag import _step  # noqa: E402


@pytest.mark.parametrize("last", [False, True], ids=["middle", "last"])
def test_lagged_split_step_leaves_the_full_steps_gradients(last):
    args = argparse.Namespace(layers=4, hidden=32, layer_range=[2, 4] if last else [1, 3], last=last, seq=8, mbs=2,
                              vocab=64)
    chunk, pstate, x, grad, undeferred = _setup(args)
    gen = torch.Generator().manual_seed(3)
    xs = [x + 0.1 * torch.randn(x.shape, generator=gen) for _ in range(4)]
    _step(chunk, xs, grad, pstate.weight_grads, undeferred, None)
    want = {name: p.grad.clone() for name, p in chunk.named_parameters()}
    for lag in (0, 1, 2, 5):  # 5 > microbatches: every W at the step's end
        _step(chunk, xs, grad, pstate.weight_grads, undeferred, lag)
        for name, p in chunk.named_parameters():
            assert torch.equal(p.grad, want[name]), (lag, name)


def test_base_split_path_loads_beside_this_one_and_leaves_the_full_steps_gradients():
    """``--base``: another checkout's split path (here this one's files, loaded a second time) is a module
    set of its own, this tree's modules stay where they were, and a lagged step through it leaves the full
    step's gradients bitwise (the layers defer to the deferral ``pstate.weight_grads`` names)."""
    import parallel3d.deferred_grads as this_deferred
    from profile_w_lag import _SPLIT_PATH, _split_path_of

    before = {name: sys.modules[name] for name in _SPLIT_PATH}
    deferral_class, split = _split_path_of(str(Path(__file__).resolve().parent.parent))
    assert {name: sys.modules[name] for name in _SPLIT_PATH} == before
    assert deferral_class is not this_deferred.WeightGradDeferral
    args = argparse.Namespace(layers=4, hidden=32, layer_range=[1, 3], last=False, seq=8, mbs=2, vocab=64)
    chunk, pstate, x, grad, undeferred = _setup(args)
    gen = torch.Generator().manual_seed(5)
    xs = [x + 0.1 * torch.randn(x.shape, generator=gen) for _ in range(3)]
    _step(chunk, xs, grad, pstate.weight_grads, undeferred, None)
    want = {name: p.grad.clone() for name, p in chunk.named_parameters()}
    pstate.weight_grads = deferral = deferral_class()
    for lag in (0, 2):
        _step(chunk, xs, grad, deferral, undeferred, lag, split)
        for name, p in chunk.named_parameters():
            assert torch.equal(p.grad, want[name]), (lag, name)
