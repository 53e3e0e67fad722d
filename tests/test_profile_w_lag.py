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
