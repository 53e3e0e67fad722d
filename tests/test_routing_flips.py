"""``tests/routing_flips.compare``: which tokens change their chosen expert set between two runs, and by what margin.

Flips come from the experts each run recorded as chosen, not from the scores' top-k (gaps47): DeepSeek's expert bias
shifts the selection, so the scores' top-k can show a flip the runs did not make, or hide one they did.
"""

from __future__ import annotations

import torch

from tests import routing_flips as rf


def _top(scores: dict, k: int) -> rf.Chosen:
    """The choice of a router without expert bias: each token's top-k."""
    return {key: tuple(v.topk(k).indices.tolist()) for key, v in scores.items()}


def test_compare_finds_the_flipped_token_its_margin_and_the_rounding():
    gen = torch.Generator().manual_seed(0)
    a = {(1, "layers.0.mlp", s, p): torch.rand(6, generator=gen, dtype=torch.float64) for s in range(2) for p in range(3)}
    b = {k: v + 1e-9 * torch.arange(6, dtype=torch.float64) for k, v in a.items()}  # rounding-sized shifts
    tied = (1, "layers.0.mlp", 1, 2)
    order = a[tied].argsort(descending=True).tolist()  # second and third best: the k = 2 boundary
    b[tied] = a[tied].clone()
    b[tied][order[1]], b[tied][order[2]] = a[tied][order[2]], a[tied][order[1]]
    (step,) = rf.compare(a, b, _top(a, 2), _top(b, 2))
    assert step.tokens == 6 and [f.key for f in step.flips] == [tied]
    assert step.flips[0].margin == abs(a[tied][order[1]] - a[tied][order[2]]).item()
    assert step.rounding == max((a[k] - b[k]).abs().max().item() for k in a if k != tied)
    assert step.near_tie() == (step.flips[0].margin <= step.rounding)


def test_compare_refuses_runs_of_different_tokens():
    a = {(1, "l", 0, 0): torch.ones(4, dtype=torch.float64)}
    try:
        b = {(1, "l", 0, 1): torch.ones(4, dtype=torch.float64)}
        rf.compare(a, b, _top(a, 1), _top(b, 1))
    except ValueError as exc:
        assert "different tokens" in str(exc)
    else:
        raise AssertionError("compare accepted runs of different tokens")


def test_flips_are_the_chosen_experts_not_the_scores_top_k():
    """Two tokens of runs routed with an expert bias (the recorded values are scores plus bias; ``chosen`` is what
    the router picked, here group-limited so not the top-k). Token ``same``: both runs chose experts {0, 3}, but
    the values' 2nd and 3rd are swapped by 1e-9: the old rule (top-k of the values) saw a flip of margin 1e-9 and
    called it a near tie. Token ``real``: the values' top-2 agree, but the runs chose {0, 1} and {0, 2}: the old rule
    saw no flip and counted the token as rounding."""
    same, real = (1, "layers.1.mlp", 0, 0), (1, "layers.1.mlp", 0, 1)
    va = torch.tensor([0.9, 0.5, 0.5 + 1e-9, 0.2], dtype=torch.float64)
    vb = torch.tensor([0.9, 0.5 + 1e-9, 0.5, 0.2], dtype=torch.float64)
    a, b = {same: va, real: va.clone()}, {same: vb, real: va + 1e-12}
    (step,) = rf.compare(a, b, {same: (0, 3), real: (0, 1)}, {same: (3, 0), real: (2, 0)})
    assert [(f.key, f.experts) for f in step.flips] == [(real, ((0, 1), (0, 2)))]
    assert step.flips[0].margin == max(abs(s[1] - s[2]).item() for s in (a[real], b[real]))
    assert step.rounding == (va - vb).abs().max().item()  # ``same`` did not flip: its shift is rounding
