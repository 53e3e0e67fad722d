"""``tests/routing_flips.compare``: which tokens change their top-k expert set between two runs, and by what margin."""

from __future__ import annotations

import torch

from tests import routing_flips as rf


def test_compare_finds_the_flipped_token_its_margin_and_the_rounding():
    gen = torch.Generator().manual_seed(0)
    a = {(1, "layers.0.mlp", s, p): torch.rand(6, generator=gen, dtype=torch.float64) for s in range(2) for p in range(3)}
    b = {k: v + 1e-9 * torch.arange(6, dtype=torch.float64) for k, v in a.items()}  # rounding-sized shifts
    tied = (1, "layers.0.mlp", 1, 2)
    order = a[tied].argsort(descending=True).tolist()  # second and third best: the k = 2 boundary
    b[tied] = a[tied].clone()
    b[tied][order[1]], b[tied][order[2]] = a[tied][order[2]], a[tied][order[1]]
    (step,) = rf.compare(a, b, top_k=2)
    assert step.tokens == 6 and [f.key for f in step.flips] == [tied]
    assert step.flips[0].margin == abs(a[tied][order[1]] - a[tied][order[2]]).item()
    assert step.rounding == max((a[k] - b[k]).abs().max().item() for k in a if k != tied)
    assert step.near_tie() == (step.flips[0].margin <= step.rounding)


def test_compare_refuses_runs_of_different_tokens():
    a = {(1, "l", 0, 0): torch.ones(4, dtype=torch.float64)}
    try:
        rf.compare(a, {(1, "l", 0, 1): torch.ones(4, dtype=torch.float64)}, top_k=1)
    except ValueError as exc:
        assert "different tokens" in str(exc)
    else:
        raise AssertionError("compare accepted runs of different tokens")
