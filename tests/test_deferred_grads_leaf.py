"""W without autograd (``leaf_grads``) against autograd's own accumulation, on generated leaf states.

Two layers whose parameters are drawn into every state ``.grad`` can be in (absent, set, a view of a shared
buffer as ZeRO's bucket binding makes it), with plain tensor hooks that pass the gradient on or replace it,
post-accumulate hooks, and a weight used twice: the split backward's ``W`` run directly (``leaf_grads``) must
leave bitwise the gradients, hook calls and ``.grad`` identities that autograd's ``W`` (and one plain backward)
leaves, and must fall back to autograd where a leaf's state is one it cannot stand in for.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from parallel3d.deferred_grads import WeightGradDeferral
from parallel3d.param_meta import set_meta
from parallel3d.tensor_parallel.deferrable_linear import deferrable_linear
from tests.op_count import OpCount


def _leaf_case(seed: int) -> dict:
    """Two layers (weight and bias each) with a drawn state: ``.grad`` absent, set, or a view of a
    shared buffer (ZeRO's bucket binding); plain-torch tensor hooks that pass the gradient on or
    replace it, post-accumulate hooks; the first layer's weight used twice (autograd sums its
    gradients before one accumulation) or not."""
    rng = random.Random(seed)
    return {"grad": [rng.choice(("none", "set", "view")) for _ in range(4)],
            "replace": [rng.random() < 0.3 for _ in range(4)], "post": [rng.randint(0, 2) for _ in range(4)],
            "twice": rng.random() < 0.3}


def _leaf_run(case: dict, mode: str) -> tuple[list[torch.Tensor], list, list[bool], Counter]:
    gen = torch.Generator().manual_seed(1)
    deferral = WeightGradDeferral(direct=mode == "direct")
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in ((5, 4), (5,), (3, 5), (3,))]
    for p in params:
        set_meta(p, wgrad_deferrable=True)
    x0 = torch.randn(6, 4, generator=gen)
    bucket = torch.randn(sum(p.numel() for p in params), generator=gen)
    views, at = [], 0
    for p, state in zip(params, case["grad"]):
        views.append(bucket[at:at + p.numel()].view_as(p))
        at += p.numel()
        p.grad = None if state == "none" else views[-1] if state == "view" else views[-1].clone()
    calls: list = []
    for i, p in enumerate(params):
        def pre(g, i=i):
            calls.append(("tensor", i))
            return g * 2 if case["replace"][i] else None
        p.register_hook(pre)
        for k in range(case["post"][i]):
            p.register_post_accumulate_grad_hook(lambda p, i=i, k=k: calls.append(("post", i, k, p.grad.sum().item())))

    def forward(x):
        w1, b1, w2, b2 = params
        h = deferrable_linear(x, w1, b1, deferral).tanh()
        if case["twice"]:
            h = h + deferrable_linear(x, w1, None, deferral).tanh()
        return deferrable_linear(h, w2, b2, deferral).sum()

    inp = x0.clone().requires_grad_(True)
    with OpCount() as ops:
        if mode == "plain":
            forward(inp).backward()
        else:
            with deferral.collecting() as work:
                forward(inp).backward(inputs=[inp])
            assert not calls
            work.run()
    still_views = [p.grad.data_ptr() == v.data_ptr() for p, v in zip(params, views)]
    return [p.grad for p in params], calls, still_views, ops.ops


@pytest.mark.parametrize("seed", range(12))
def test_w_without_autograd_accumulates_and_fires_hooks_as_autograd_does(seed):
    """Against one plain backward: bitwise the same ``.grad`` (a bucket-bound ``.grad`` still the
    bucket's memory), the same tensor and post-accumulate hook calls in the same order, each once;
    a parameter queued twice in one W makes W take autograd's path (which sums before accumulating)."""
    case = _leaf_case(seed)
    plain_grads, plain_calls, plain_views, _ = _leaf_run(case, "plain")
    for mode in ("direct", "graph"):
        grads, calls, views, ops = _leaf_run(case, mode)
        assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads)), (case, mode)
        assert views == plain_views, (case, mode)
        # the order among parameters is W's (last queued first); per parameter it is autograd's
        for i in range(4):
            assert [c for c in calls if c[1] == i] == [c for c in plain_calls if c[1] == i], (case, mode, i)
        assert len(calls) == len(plain_calls)
        through_graph = mode == "graph" or case["twice"]
        assert ops["aten.zeros"] == (1 if through_graph else 0), (case, mode)  # W's graph anchor, or none


def test_generated_leaf_cases_cover_every_state():
    cases = [_leaf_case(s) for s in range(12)]
    assert {g for c in cases for g in c["grad"]} == {"none", "set", "view"}
    assert any(c["twice"] for c in cases) and not all(c["twice"] for c in cases)
    assert any(r for c in cases for r in c["replace"]) and any(p == 2 for c in cases for p in c["post"])


def test_w_takes_autograd_for_a_parameter_leaf_grads_cannot_stand_in_for():
    """A non-leaf or non-contiguous parameter: W goes through autograd (its graph anchor runs)."""
    from parallel3d.leaf_grads import accepts, all_accepted

    leaf = torch.nn.Parameter(torch.randn(4, 3))
    assert accepts(leaf) and all_accepted([leaf, None])
    assert not accepts(leaf * 2)
    assert not accepts(torch.nn.Parameter(torch.randn(3, 4)).t())
    assert not all_accepted([leaf, leaf])
    assert all_accepted([leaf, torch.randn(2)])  # no gradient needed: not accumulated, not checked


def test_w_without_autograd_checks_and_casts_gradients_as_autograd_does():
    """A gradient of another dtype is cast to the parameter's (autograd's output check); a wrong shape
    or a tensor hook that changes the shape raises, in W as in a plain backward."""
    from parallel3d.leaf_grads import accumulate

    p = torch.nn.Parameter(torch.randn(3, 2))
    with torch.no_grad():
        accumulate(p, torch.ones(3, 2, dtype=torch.float64))
    assert p.grad.dtype == torch.float32 and torch.equal(p.grad, torch.ones(3, 2))
    with pytest.raises(RuntimeError, match="shape"), torch.no_grad():
        accumulate(p, torch.ones(2, 3))
    w = set_meta(torch.nn.Parameter(torch.randn(3, 4)), wgrad_deferrable=True)
    w.register_hook(lambda g: g[:1])
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="hook"):
        deferrable_linear(x, w, None, None).sum().backward()  # autograd refuses the hook's gradient too
    deferral = WeightGradDeferral()
    with deferral.collecting() as work:
        deferrable_linear(x, w, None, deferral).sum().backward(inputs=[x])
    with pytest.raises(RuntimeError, match="hook"):
        work.run()


def test_accumulate_each_skips_what_autograd_would_not_accumulate():
    """``accumulate_each`` over one closure's parameters: a missing gradient, a missing parameter and a
    parameter needing no gradient are skipped (autograd: no edge, no accumulation); the others end as
    autograd's accumulation leaves them (first adopted, then added in place), each post hook once."""
    from parallel3d.leaf_grads import accumulate_each

    gen = torch.Generator().manual_seed(3)
    frozen = torch.nn.Parameter(torch.randn(2, 3, generator=gen), requires_grad=False)
    plain, direct = (torch.nn.Parameter(torch.randn(4, 3, generator=gen)) for _ in range(2))
    direct.data.copy_(plain.data)
    others = [torch.nn.Parameter(torch.randn(5, generator=gen)) for _ in range(2)]  # their gradient missing
    grads = [torch.randn(4, 3, generator=gen) for _ in range(2)]
    fired: list[int] = []
    direct.register_post_accumulate_grad_hook(lambda p: fired.append(len(fired)))
    for g in grads:
        (plain * g).sum().backward()  # autograd's AccumulateGrad: d/dp sum(p * g) = g
        with torch.no_grad():
            accumulate_each([frozen, None, direct, others[1]], [torch.ones(2, 3), torch.ones(1), g.clone(), None])
    assert torch.equal(direct.grad, plain.grad) and fired == [0, 1]
    assert frozen.grad is None and all(p.grad is None for p in others)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "graph"])
@pytest.mark.parametrize("returned", [0, 1, 3])
def test_w_refuses_a_closure_that_returns_another_number_of_gradients(direct, returned):
    """Each closure returns one gradient per parameter it queued for (None for one it has none for); W
    checks the count on either route, before accumulating anything."""
    deferral = WeightGradDeferral(direct=direct)
    w = set_meta(torch.nn.Parameter(torch.randn(3, 4)), wgrad_deferrable=True)
    b = set_meta(torch.nn.Parameter(torch.randn(3)), wgrad_deferrable=True)
    grads = [torch.ones(3, 4), torch.ones(3), torch.ones(3)][:returned]
    with deferral.collecting() as work:
        assert deferral.defer((w, b), lambda: grads, ())
    with pytest.raises(ValueError, match=f"returned {returned} gradients for 2 parameters"):
        work.run()
    assert w.grad is None and b.grad is None
