"""The single-process MoE layer (run in float64) against the float64 token-by-token reference, its parameter
naming and layout-independent init, uninitialised-memory poison, and the pipeline split backward.

Cases are generated (seeded): expert counts, top-k, score functions, normalisation,
group-limited routing, expert bias, shared experts (gated or not), both loss scopes,
dropless and capacity routing with both drop policies, pad-to-capacity, both dispatchers,
and experts that receive no token.
"""

from __future__ import annotations

import random

import pytest
import torch

from parallel3d.moe import finish_step
from parallel3d.moe.experts import GroupedExperts
from tests import moe_reference as ref
from tests.moe_cases import (
    PREFIX, build_layer, by_global_name, dead_experts, inputs, poisoned_empty, random_options, rel_err,
)

CASES = 10


def _variant(rng: random.Random, i: int) -> dict:
    kinds = [dict(), dict(capacity_factor=rng.choice([0.5, 1.0]), drop_policy="probs"),
             dict(capacity_factor=rng.choice([0.5, 1.0]), drop_policy="position"),
             dict(capacity_factor=1.0, pad_to_capacity=True), dict(dispatcher="allgather")]
    return kinds[i % len(kinds)]


def _run_case(seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    o = random_options(rng, **_variant(rng, seed))
    layer = build_layer(o, dead=dead_experts(rng, o), dtype=torch.float64)
    b, s = rng.randint(1, 3), rng.randint(1, 5)
    x, cot = inputs(seed, b, s, torch.float64)
    x.requires_grad_(True)
    out = layer(x)
    (out * cot).sum().backward()
    params = {name: p.detach().double().requires_grad_(True) for name, p in by_global_name(layer).items()}
    bias = None if layer.router.expert_bias is None else layer.router.expert_bias.double()
    x64 = x.detach().double().requires_grad_(True)
    ids = [bi * (1 << 32) + si for bi in range(b) for si in range(s)]
    out64, aux, z, weighted = ref.moe_forward(x64, params, o, PREFIX, ids, bias)
    ((out64 * cot.double()).sum() + weighted).backward()
    errs = {"out": rel_err(out, out64), "x.grad": rel_err(x.grad, x64.grad)}
    for name, p in by_global_name(layer).items():
        errs[name] = rel_err(p.grad, params[name].grad) if params[name].grad is not None else float(p.grad.abs().max())
    metrics = finish_step({"l": layer}, None)[0]
    errs["aux value"] = abs(metrics.aux_loss - aux.item()) / aux.item()
    errs["z value"] = abs(metrics.z_loss - z.item()) / z.item()
    _, indices, _, _ = ref.route(x64.detach().reshape(b * s, -1), params[f"{PREFIX}.router.weight"].detach(), o, bias)
    counts = [float(sum(row.count(e) for row in indices)) for e in range(o.num_experts)]
    errs["tokens per expert"] = float(metrics.tokens_per_expert != counts)
    return errs


@pytest.mark.parametrize("seed", range(CASES))
def test_layer_matches_float64_reference(seed: int) -> None:
    errs = _run_case(seed)
    bad = {k: v for k, v in errs.items() if v > 1e-10}
    assert not bad, f"case {seed}: {bad}"


def test_expert_weights_are_the_same_in_every_layout() -> None:
    """Expert e's etp slice on any (ep, etp) layout equals the slice of the single-process weight."""
    full = GroupedExperts(8, 6, 12, first=0, num_local=8, prefix=PREFIX, seed=5)
    for ep, etp in ((2, 1), (4, 2), (8, 3)):
        for ep_rank in range(ep):
            for etp_rank in range(etp):
                part = GroupedExperts(8, 6, 12, first=ep_rank * 8 // ep, num_local=8 // ep, prefix=PREFIX, seed=5,
                                      etp_rank=etp_rank, etp_size=etp)
                for key, expert in part.items():
                    assert int(key) in range(ep_rank * 8 // ep, (ep_rank + 1) * 8 // ep)
                    ref_expert = full[key]
                    for name, dim in (("w1", 0), ("w3", 0), ("w2", 1)):
                        got, want = getattr(expert, name), getattr(ref_expert, name).chunk(etp, dim)[etp_rank]
                        assert torch.equal(got, want), (ep, etp, key, name)
                        assert got.global_name == f"{PREFIX}.experts.{key}.{name}" and got.expert_index == int(key)


def test_state_dict_keys_use_global_expert_indices() -> None:
    part = GroupedExperts(8, 4, 4, first=6, num_local=2, prefix=PREFIX)
    assert sorted(part.state_dict()) == [f"{e}.{w}" for e in (6, 7) for w in ("w1", "w2", "w3")]


@pytest.mark.parametrize("backend", ["grouped_mm", "loop"])
def test_no_uninitialised_row_with_zero_token_experts(backend: str) -> None:
    """Most experts get no token at all; every output and gradient must still be finite and right."""
    rng = random.Random(3)
    o = random_options(rng, num_experts=8, top_k=1, ffn_hidden=4, num_groups=1, topk_groups=1, gemm_backend=backend,
                       num_shared_experts=0, shared_expert_gate=False)
    dead = [e for e in range(8) if e not in (2, 5)]
    with poisoned_empty():
        layer = build_layer(o, dead=dead)
        x, cot = inputs(4, 2, 3)
        x.requires_grad_(True)
        out = layer(x)
        (out * cot).sum().backward()
        grads = [x.grad] + [p.grad for p in layer.parameters()]
        assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
        for e in dead:
            for w in layer.experts[str(e)].parameters():
                assert torch.equal(w.grad, torch.zeros_like(w)), f"expert {e} had no token but a nonzero gradient"
    assert layer.stats.values[:8][dead].sum() == 0


@pytest.mark.parametrize("variant", [dict(), dict(capacity_factor=1.0), dict(capacity_factor=1.0, pad_to_capacity=True),
                                     dict(dispatcher="allgather"), dict(aux_loss_scope="sequence")])
def test_a_rank_with_no_tokens(variant: dict) -> None:
    """A micro-batch slice with no tokens (b = 0 or s = 0) passes through with finite losses and gradients."""
    o = random_options(random.Random(1), num_experts=4, top_k=2, aux_loss_coeff=0.1, z_loss_coeff=0.1,
                       num_groups=1, topk_groups=1, **variant)
    layer = build_layer(o, dead=[])
    for shape in ((0, 3), (2, 0)):
        x = torch.zeros(*shape, 8, requires_grad=True)
        out = layer(x)
        out.sum().backward()
        assert out.shape == x.shape
        assert all(torch.isfinite(p.grad).all() for p in layer.parameters() if p.grad is not None)
    metrics = finish_step({"l": layer}, None)[0]
    assert metrics.tokens_per_expert == [0.0] * 4 and metrics.aux_loss == 0.0
