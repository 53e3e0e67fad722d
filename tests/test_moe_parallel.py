"""Expert parallelism on real gloo ranks against the single process.

Grids: ep in {2, 4}, etp in {1, 2}, an expert-data-parallel dimension, and token groups
(ranks splitting one micro-batch's sequence, as sequence / context parallel do) of 1, 2
and 4 ranks. Every rank builds the expert-parallel layer and, beside it, the single-process
layer (same seed, same names) which it runs on every micro-batch of the world. Checked:

- dispatch then combine restores the input and its gradient (both dispatchers, capacity
  drops, zero-token experts, NCCL-emulated count exchange with one host sync per dispatch);
- the layer's output, input gradient, every expert gradient (summed over expert-data-
  parallel ranks only), router / shared-expert / gate gradients (summed over all ranks)
  equal the single process to 1e-6 relative (fp32), dropless and with capacity;
- the step's metrics and the expert-bias update equal the single process's;
- the NCCL emulation makes a count buffer read before its wait visible.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from parallel3d.moe import finish_step
from parallel3d.moe.collectives import POISON, exchange_counts, to_host
from parallel3d.moe.dispatcher_allgather import AllGatherDispatcher
from parallel3d.moe.dispatcher_alltoall import AllToAllDispatcher
from tests.harness import run_on_ranks
from tests.moe_cases import ExpertGrid, build_layer, by_global_name, dead_experts, inputs, random_options, rel_err

TOL = 1e-6
# The router's weight gradient sums every token's contribution on its rank, then over the world
# (all-reduce); one process sums them in one GEMM. Two fp32 summation orders of a cancelling sum
# differ by a few ulps of its largest term (1.6e-6 measured on one Xeon's GEMM kernels): still
# 2,000x below a bf16 rounding (4e-3) or a gradient scaled by the group size.
ROUTER_GRAD_TOL = 4e-6


def _tol(what: str) -> float:
    return ROUTER_GRAD_TOL if what.endswith("router.weight") and " grad " in what else TOL


# ---- dispatch then combine ----------------------------------------------------------------------
def _roundtrip(rank: int, world: int, etp: int, ep: int, seeds: list[int]) -> list[tuple[str, float]]:
    grid = ExpertGrid.build(rank, world, etp, ep, span=1)
    out = []
    for seed in seeds:
        shared = random.Random(seed)  # what all ranks agree on
        num_experts = ep * shared.choice([1, 2, 3])
        k = shared.randint(1, min(3, num_experts))
        rng = random.Random(seed * 1000 + rank)  # every rank routes its own tokens differently
        t, h = rng.randint(0, 9), 6
        g = torch.Generator().manual_seed(seed * 7 + rank)
        x = torch.randn(t, h, generator=g, dtype=torch.float64).requires_grad_(True)
        live = sorted(random.Random(seed).sample(range(num_experts), max(k, num_experts // 2)))  # others: no tokens
        indices = torch.stack([torch.tensor(rng.sample(live, k)) for _ in range(t)]) if t else torch.zeros(0, k).long()
        weights = torch.softmax(torch.randn(t, k, generator=g, dtype=torch.float64), -1).requires_grad_(True)
        keep = torch.rand(t, k, generator=g) < 0.7 if seed % 2 else None
        cot = torch.randn(t, h, generator=g, dtype=torch.float64)
        for name in ("alltoall", "alltoall_nccl", "allgather"):
            if name == "allgather":
                d = AllGatherDispatcher(num_experts, grid.groups["ep"], grid.groups["etp"])
            else:
                d = AllToAllDispatcher(num_experts, grid.groups["ep"], grid.groups["etp"],
                                       emulate_nccl=name.endswith("nccl"))
            x.grad = weights.grad = None
            sent = d.dispatch(x, indices, keep)
            combined = d.combine(sent.rows / etp, sent, weights)  # identity experts, partial over etp
            (combined * cot).sum().backward()
            kept_w = weights if keep is None else weights * keep
            want = x * kept_w.sum(-1, keepdim=True)
            out.append((f"{name} seed {seed} out", rel_err(combined, want)))
            out.append((f"{name} seed {seed} x.grad", rel_err(x.grad, cot * kept_w.sum(-1, keepdim=True))))
            w_grad = (x * cot).sum(-1, keepdim=True).expand(t, k)
            w_grad = w_grad if keep is None else w_grad * keep
            out.append((f"{name} seed {seed} weights.grad", rel_err(weights.grad, w_grad)))
            out.append((f"{name} seed {seed} host syncs", float(d.host_syncs.count != 1)))
    return out


@pytest.mark.parametrize("etp,ep", [(1, 2), (1, 4), (2, 2)])
def test_dispatch_then_combine_restores_input_and_gradient(etp: int, ep: int) -> None:
    for rank, checks in enumerate(run_on_ranks(_roundtrip, etp * ep, etp, ep, [0, 1, 2, 3])):
        bad = [(what, err) for what, err in checks if err > 1e-12]
        assert not bad, f"rank {rank}: {bad}"


# ---- the layer under expert parallelism vs the single process -----------------------------------
VARIANTS = {
    "dropless": lambda rng: {},
    "capacity_probs": lambda rng: dict(capacity_factor=rng.choice([0.5, 1.0]), drop_policy="probs"),
    "capacity_position": lambda rng: dict(capacity_factor=rng.choice([0.5, 1.0]), drop_policy="position"),
    "pad_to_capacity": lambda rng: dict(capacity_factor=1.0, pad_to_capacity=True),
    "allgather": lambda rng: dict(dispatcher="allgather"),
    "global_aux": lambda rng: dict(aux_loss_scope="global", aux_loss_coeff=0.1, z_loss_coeff=0.0),
}


def _slice_tokens(t: torch.Tensor, grid: ExpertGrid, s_local: int) -> torch.Tensor:
    return t[:, grid.token_rank * s_local:(grid.token_rank + 1) * s_local]


def _token_ids(b: int, s: int) -> torch.Tensor:
    return torch.arange(b).view(b, 1) * (1 << 32) + torch.arange(s).view(1, s)


def _layer_vs_single(rank: int, world: int, etp: int, ep: int, span: int, variant: str, seeds: list[int],
                     emulate_nccl: bool = False) -> list[tuple[str, float]]:
    grid = ExpertGrid.build(rank, world, etp, ep, span)
    checks: list[tuple[str, float]] = []
    for seed in seeds:
        rng = random.Random(seed)
        o = random_options(rng, ep=ep, etp=etp, **VARIANTS[variant](rng))
        dead = dead_experts(rng, o)
        b, s_local = rng.randint(1, 2), rng.randint(1, 4)
        layer = build_layer(o, dead=dead, ep_group=grid.groups["ep"], etp_group=grid.groups["etp"],
                            token_group=grid.groups["token"], global_group=grid.groups["world"],
                            emulate_nccl=emulate_nccl)
        single = build_layer(o, dead=dead)
        batches = [inputs(seed * 100 + mb, b, s_local * span) for mb in range(world // span)]
        x_full, cot_full = batches[grid.micro_batch]
        x = _slice_tokens(x_full, grid, s_local).clone().requires_grad_(True)
        out = layer(x, _slice_tokens(_token_ids(b, s_local * span), grid, s_local))
        (out * _slice_tokens(cot_full, grid, s_local)).sum().backward()
        ref_x = [xb.clone().requires_grad_(True) for xb, _ in batches]
        if o.aux_loss_scope == "global":  # the pooled set is every micro-batch of this micro-step
            ref_out = single(torch.cat(ref_x), _token_ids(b * len(batches), s_local * span)).split(b)
            (torch.cat(ref_out) * torch.cat([c for _, c in batches])).sum().backward()
        else:
            ref_out = [single(xb, _token_ids(b, s_local * span)) for xb in ref_x]
            for ro, (_, cb) in zip(ref_out, batches):
                (ro * cb).sum().backward()
        tag = f"{variant} seed {seed}"
        checks.append((f"{tag} out", rel_err(out, _slice_tokens(ref_out[grid.micro_batch], grid, s_local))))
        checks.append((f"{tag} x.grad", rel_err(x.grad, _slice_tokens(ref_x[grid.micro_batch].grad, grid, s_local))))
        ref_params = by_global_name(single)
        for name, p in by_global_name(layer).items():
            grad = p.grad.clone() if p.grad is not None else torch.zeros_like(p)  # e.g. a router left out of the graph
            expert = getattr(p, "expert_index", None) is not None
            group = grid.groups["edp"] if expert else grid.groups["world"]
            if group is not None:
                dist.all_reduce(grad, group=group)
            want = ref_params[name].grad
            want = torch.zeros_like(p) if want is None else want
            if expert:
                want = want.chunk(etp, p.etp_split_dim)[grid.etp_rank]
            checks.append((f"{tag} grad {name}", rel_err(grad, want)))
        if o.aux_loss_scope != "global":
            got = finish_step({"l": layer}, grid.groups["world"])[0]
            ref = finish_step({"l": single}, None)[0]
            checks.append((f"{tag} tokens per expert", float(got.tokens_per_expert != ref.tokens_per_expert)))
            checks.append((f"{tag} dropped", abs(got.dropped_fraction - ref.dropped_fraction)))
            checks.append((f"{tag} aux loss", abs(got.aux_loss - ref.aux_loss) / max(ref.aux_loss, 1e-30)))
            checks.append((f"{tag} z loss", abs(got.z_loss - ref.z_loss) / max(ref.z_loss, 1e-30)))
            if layer.router.expert_bias is not None:
                checks.append((f"{tag} expert bias", rel_err(layer.router.expert_bias, single.router.expert_bias)))
    return checks


LAYOUTS = [  # (world, etp, ep, span): span ranks split one micro-batch
    (2, 1, 2, 1), (2, 1, 2, 2), (4, 1, 4, 1), (4, 1, 4, 4), (4, 2, 2, 2), (4, 1, 2, 2), (4, 2, 2, 1),
]


@pytest.mark.parametrize("world,etp,ep,span", LAYOUTS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_layer_equals_single_process(world: int, etp: int, ep: int, span: int, variant: str) -> None:
    seeds = [world * 31 + etp * 7 + ep + span * 3 + i for i in range(2)]
    for rank, checks in enumerate(run_on_ranks(_layer_vs_single, world, etp, ep, span, variant, seeds)):
        bad = [(what, err) for what, err in checks if err > _tol(what)]
        assert not bad, f"rank {rank} (etp={etp} ep={ep} span={span}): {bad}"


def test_layer_under_emulated_nccl_equals_single_process() -> None:
    for rank, checks in enumerate(run_on_ranks(_layer_vs_single, 4, 2, 2, 2, "dropless", [5, 6], True)):
        bad = [(what, err) for what, err in checks if err > _tol(what)]
        assert not bad, f"rank {rank}: {bad}"


# ---- the NCCL emulation itself ------------------------------------------------------------------
def _read_before_wait(rank: int, world: int) -> tuple[list[int], list[int], str]:
    send = torch.arange(world, dtype=torch.int64) + 10 * rank
    pending = exchange_counts(send, dist.group.WORLD, emulate_nccl=True)
    early = pending.output.tolist()  # what code that forgot the wait reads on NCCL: not the counts
    try:
        to_host(pending.output, None)
        message = ""
    except RuntimeError as exc:
        message = str(exc)
    return early, pending.wait().tolist(), message


def test_emulated_count_exchange_is_invalid_until_waited() -> None:
    for rank, (early, final, message) in enumerate(run_on_ranks(_read_before_wait, 2)):
        assert early == [POISON] * 2
        assert final == [10 * src + rank for src in range(2)]
        assert "read before their exchange completed" in message


# ---- the micro-benchmark ------------------------------------------------------------------------
def _bench(rank: int, world: int) -> dict[str, float]:
    from parallel3d.moe.bench import bench_dispatch_vs_experts

    grid = ExpertGrid.build(rank, world, 1, world, span=1)
    o = random_options(random.Random(1), ep=world, num_experts=4, top_k=2, num_groups=1, topk_groups=1)
    layer = build_layer(o, dead=[], ep_group=grid.groups["ep"])
    x, _ = inputs(rank, 2, 8)
    return bench_dispatch_vs_experts(layer, x, steps=2)


def test_bench_reports_every_phase() -> None:
    for result in run_on_ranks(_bench, 2):
        for phase in ("route", "dispatch", "experts", "combine", "forward_backward"):
            assert 0 < result[f"{phase}_s"] < 60, (phase, result)
        assert result["tokens"] == 16 and result["expert_rows"] >= 0 and result["dispatch_over_experts"] > 0
