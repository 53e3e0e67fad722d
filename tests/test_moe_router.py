"""Router, balancing losses, expert bias and options against independent computations.

- routing (softmax / sigmoid, normalisation, scaling, group-limited, expert bias) equals the
  float64 token loop of ``tests.moe_reference``; the bias chooses but never weights;
- the aux (micro-batch and sequence scopes) and z loss values equal float64 formulas, and
  their injected gradient (times ``aux_loss_scale``) equals adding them to the loss;
- step statistics count each micro-batch once (gradient accumulation, activation recompute,
  no count in no-grad forwards) and the bias update sees the whole step's load;
- bad options fail with one line naming the option, the value and what is allowed.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from parallel3d.moe import MoEOptionError, MoEOptions, TopKRouter, finish_step
from parallel3d.moe.load_balance import balance_terms
from tests import moe_reference as ref
from tests.moe_cases import PREFIX, build_layer, by_global_name, inputs, random_options, rel_err


@pytest.mark.parametrize("seed", range(8))
def test_routing_equals_float64_reference(seed: int) -> None:
    rng = random.Random(seed)
    groups, top_k = rng.choice([1, 2, 4]), rng.randint(1, 4)
    topk_groups = min(groups, max(2, -(-top_k // (8 // groups))))
    o = random_options(rng, num_experts=8, num_groups=groups, top_k=top_k, topk_groups=topk_groups,
                       bias_update_rate=0.01)
    router = TopKRouter(o, 6, global_name="r", seed=seed, init_std=0.5, dtype=torch.float64)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        router.expert_bias.copy_(torch.randn(8, generator=g, dtype=torch.float64) * 0.05)
    x = torch.randn(20, 6, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    got = router(x)
    weights, indices, _, _ = ref.route(x, router.weight.detach(), o, router.expert_bias)
    assert got.indices.tolist() == indices
    assert rel_err(got.weights, weights) < 1e-12
    if o.num_groups > 1:
        per_group = 8 // o.num_groups
        for row in indices:
            assert len({e // per_group for e in row}) <= o.topk_groups


def test_bias_chooses_but_never_weights() -> None:
    o = MoEOptions(num_experts=4, top_k=2, ffn_hidden=4, normalize_topk=False, score_function="sigmoid",
                   bias_update_rate=0.1)
    router = TopKRouter(o, 6, global_name="r", init_std=0.5)
    with torch.no_grad():
        router.expert_bias[3] = 100.0
    x = torch.randn(10, 6, generator=torch.Generator().manual_seed(0))
    routing = router(x)
    assert (routing.indices == 3).any(-1).all()
    assert torch.equal(routing.weights, routing.scores.gather(1, routing.indices))


@pytest.mark.parametrize("scope", ["micro_batch", "sequence"])
def test_loss_values_equal_float64_formulas(scope: str) -> None:
    for seed in range(4):
        o = random_options(random.Random(seed), num_experts=6, aux_loss_scope=scope, aux_loss_coeff=0.1,
                           z_loss_coeff=0.01, num_groups=1, topk_groups=1)
        router = TopKRouter(o, 5, global_name="r", seed=seed, init_std=0.7, dtype=torch.float64)
        b, s = 3, 4
        x = torch.randn(b * s, 5, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        terms = balance_terms(router(x), o, b, s, token_group=None)
        _, indices, logits, scores = ref.route(x, router.weight.detach(), o)
        probs = ref.balance_probs(scores, o)
        if scope == "sequence":
            aux = sum(ref.aux_loss(indices[i * s:(i + 1) * s], probs[i * s:(i + 1) * s], o, 6) for i in range(b)) / b
        else:
            aux = ref.aux_loss(indices, probs, o, 6)
        assert abs(terms.aux.item() - float(aux)) < 1e-12 * max(1.0, float(aux))
        assert abs(terms.z.item() - float(ref.z_loss(logits))) < 1e-12 * float(ref.z_loss(logits))
        assert float(terms.token_share) == 1.0


def test_injected_gradient_is_scaled_like_the_main_loss() -> None:
    """With ``aux_loss_scale = c`` the router gradient is that of ``c * (main + weighted losses)``."""
    o = random_options(random.Random(2), num_experts=4, top_k=2, aux_loss_coeff=0.3, z_loss_coeff=0.05,
                       num_groups=1, topk_groups=1, num_shared_experts=0, shared_expert_gate=False)
    layer = build_layer(o, dead=[], dtype=torch.float64)
    layer.aux_loss_scale = 0.25
    x, cot = inputs(3, 2, 3, torch.float64)
    (layer(x) * cot * 0.25).sum().backward()
    params = {n: p.detach().clone().requires_grad_(True) for n, p in by_global_name(layer).items()}
    ids = list(range(6))
    out, _, _, weighted = ref.moe_forward(x, params, o, PREFIX, [i for i in ids])
    (0.25 * ((out * cot).sum() + weighted)).backward()
    name = f"{PREFIX}.router.weight"
    assert rel_err(layer.router.weight.grad, params[name].grad) < 1e-10


def _step(layer, batches: list[torch.Tensor], recompute: bool = False) -> None:
    for x in batches:
        x = x.clone().requires_grad_(True)
        out = checkpoint(layer, x, use_reentrant=False) if recompute else layer(x)
        out.square().sum().backward()


def test_step_statistics_and_bias_update_under_gradient_accumulation() -> None:
    o = random_options(random.Random(5), num_experts=6, top_k=2, bias_update_rate=0.01, num_groups=1,
                       topk_groups=1, aux_loss_scope="sequence", aux_loss_coeff=0.1)
    x, _ = inputs(9, 4, 5, torch.float64)
    whole = build_layer(o, dead=[], dtype=torch.float64)
    _step(whole, [x])
    with torch.no_grad():  # an evaluation forward counts nothing
        whole(x)
    accumulated = build_layer(o, dead=[], dtype=torch.float64)
    _step(accumulated, list(x.split(1)), recompute=True)  # 4 micro-batches, each forward run twice
    assert accumulated.stats.micro_batches == 4 and whole.stats.micro_batches == 1
    before = whole.router.expert_bias.clone()
    got, want = finish_step({"l": accumulated}, None)[0], finish_step({"l": whole}, None)[0]
    assert got.tokens_per_expert == want.tokens_per_expert and sum(want.tokens_per_expert) == 4 * 5 * 2
    assert abs(got.aux_loss - want.aux_loss) < 1e-12  # per-sequence: independent of the micro-batch split
    assert torch.equal(accumulated.router.expert_bias, whole.router.expert_bias)
    load = torch.tensor(want.tokens_per_expert, dtype=torch.float64)
    assert torch.allclose(whole.router.expert_bias - before, 0.01 * torch.sign(load.mean() - load).float())
    assert whole.stats.micro_batches == 0 and not whole.stats.values.any()


BAD_OPTIONS = [
    (dict(score_function="relu"), "moe.score_function='relu': allowed softmax, sigmoid"),
    (dict(top_k=9), "moe.top_k=9: allowed 1..num_experts (8)"),
    (dict(num_groups=3), "moe.num_groups=3: must divide num_experts=8"),
    (dict(num_groups=4, topk_groups=1, top_k=3),
     "moe.topk_groups=1: the chosen groups hold 2 experts, fewer than top_k=3"),
    (dict(capacity_factor=0.0), "moe.capacity_factor=0.0: must be a number > 0, or None (dropless)"),
    (dict(pad_to_capacity=True), "moe.pad_to_capacity=True: needs a capacity_factor"),
    (dict(drop_policy="random"), "moe.drop_policy='random': allowed probs, position"),
    (dict(aux_loss_scope="batch"), "moe.aux_loss_scope='batch': allowed micro_batch, sequence, global"),
    (dict(z_loss_coeff=-1.0), "moe.z_loss_coeff=-1.0: must be a number >= 0"),
    (dict(shared_expert_gate=True), "moe.shared_expert_gate=True: needs num_shared_experts >= 1"),
    (dict(dispatcher="flex"), "moe.dispatcher='flex': allowed alltoall, allgather"),
]


@pytest.mark.parametrize("bad,message", BAD_OPTIONS)
def test_bad_options_name_key_value_and_allowed(bad: dict, message: str) -> None:
    with pytest.raises(MoEOptionError) as info:
        MoEOptions(**{**dict(num_experts=8, top_k=2, ffn_hidden=4), **bad})
    assert str(info.value).startswith(message) and "\n" not in str(info.value)
