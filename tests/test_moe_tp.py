"""MoE models under tensor parallelism with sequence parallel, on real gloo ranks, against one process.

With sequence parallel each tp rank routes only its chunk of the sequence, so the router,
shared-expert and shared-expert-gate weight gradients are partial sums over tp that the model
must complete (``models.moe_block``). The reference is the same model (same seed: layout-
independent init) built with ``ParallelState.single_process()`` on every rank and run on the
whole batch, in float64. Checked on 2 ranks at tp=2 for every expert fold the 2 ranks allow
(etp=2 ep=1; etp=1 ep=2; etp=1 ep=1: experts replicated over tp), and on 4 ranks (slow) with
etp != tp both ways:

- the loss (aux and z losses in the backward) and every parameter's gradient: replicated ones
  (router, shared experts, gate, norms) as they stand on each rank, tp-split ones against the
  reference's slice, expert ones summed over their replicas (edp) against the etp slice;
- a shared-expert gate (Qwen2-MoE; no preset has one) through ``moe_mlp`` on its own;
- the shared experts are split over tp like the dense MLP: each tp rank holds 1/tp of every
  shared-expert weight (its slice of the one-process weight, by value), the tp ranks' slices
  together are the whole weight, and the gate and router stay whole.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from models import build_model, get_config
from models.blocks import BuildContext
from models.moe_block import moe_mlp
from parallel3d.context_parallel.model_attention import ContextParallelAttention
from parallel3d.context_parallel.options import ContextParallelOptions
from parallel3d.parallel_state import ParallelState
from parallel3d.param_meta import tp_split_dim
from parallel3d.topology import Topology
from tests.harness import run_on_ranks

B, S = 2, 8
TOL = 1e-6  # tp=1 computes the loss in float32 (kernels.dispatch), as in tests/test_models.py
# Aux (both scopes) and z losses on, so their injected gradients reach the router too.
LOSSES = [dict(aux_loss_coeff=0.05, aux_loss_scope="micro_batch", z_loss_coeff=0.01),
          dict(aux_loss_coeff=0.05, aux_loss_scope="sequence")]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _grad_errors(model: torch.nn.Module, ref: torch.nn.Module, pstate: ParallelState) -> dict[str, float]:
    """Each parameter's gradient error against the reference's (module docstring)."""
    ref_grads = {p.global_name: p.grad for p in ref.parameters()}
    tp, etp = pstate.size("tp"), pstate.size("etp")
    out = {}
    for p in model.parameters():
        name, grad = p.global_name, p.grad.clone()
        want = ref_grads[name]
        if getattr(p, "expert_index", None) is not None:
            if pstate.size("edp") > 1:
                dist.all_reduce(grad, group=pstate.group("edp"))
            want = want.chunk(etp, p.etp_split_dim)[pstate.coord("etp")]
        elif tp_split_dim(p) is not None:
            dim = tp_split_dim(p)
            want = want.narrow(dim, pstate.coord("tp") * p.shape[dim], p.shape[dim])  # padded rows: none here
        out[name] = _rel(grad, want)
    return out


def _shared_expert_holdings(model: torch.nn.Module, ref: torch.nn.Module, pstate: ParallelState) -> dict:
    """Per shared-expert / gate / router weight: the fraction of the reference's elements this rank holds,
    whether they are the reference's slice along the tp split, and the tp ranks' numels summed."""
    ref_params = {p.global_name: p for p in ref.parameters()}
    out = {}
    for p in model.parameters():
        name = p.global_name
        if ".shared_expert" not in name and ".router." not in name:
            continue
        want = ref_params[name].detach()
        dim = tp_split_dim(p)
        if dim is not None:
            want = want.narrow(dim, pstate.coord("tp") * p.shape[dim], p.shape[dim])
        total = torch.tensor(float(p.numel()), dtype=torch.float64)
        if pstate.size("tp") > 1:
            dist.all_reduce(total, group=pstate.group("tp"))
        out[name] = dict(fraction=p.numel() / ref_params[name].numel(), split=dim,
                         same=p.shape == want.shape and torch.equal(p.detach(), want),
                         tp_total=int(total.item()), whole=ref_params[name].numel())
    return out


def _model_vs_single(rank: int, world: int, layouts: list[dict], models: list[str], **overrides) -> list[dict]:
    ids = torch.randint(0, 500, (B, S), generator=torch.Generator().manual_seed(5))
    labels = torch.randint(0, 500, (B, S), generator=torch.Generator().manual_seed(6))
    out = []
    for layout in layouts:
        pstate = ParallelState(Topology(**layout))
        for name in models:
            for losses in LOSSES:
                cfg = get_config(name, moe=losses, **overrides)
                model = build_model(cfg, pstate, seed=3, dtype=torch.float64, sequence_parallel=True)
                ref = build_model(cfg, ParallelState.single_process(), seed=3, dtype=torch.float64)
                loss, ref_loss = model(ids, labels=labels), ref(ids, labels=labels)
                loss.backward()
                ref_loss.backward()
                errors = _grad_errors(model, ref, pstate)
                held = _shared_expert_holdings(model, ref, pstate)
                worst = max(errors, key=errors.get)
                routers = max(v for k, v in errors.items() if ".router." in k or ".shared_expert" in k)
                out.append(dict(case=f"{name} {layout} {losses}", loss=_rel(loss, ref_loss), worst=worst,
                                grads=errors[worst], router_and_shared=routers, held=held,
                                tp=pstate.size("tp")))
        pstate.destroy()
    return out


def _check(results: list[list[dict]]) -> None:
    for rank, rows in enumerate(results):
        for r in rows:
            assert r["loss"] < TOL and r["grads"] < TOL and r["router_and_shared"] < TOL, (rank, r)
            assert "deepseek" not in r["case"] or any(".shared_experts." in n for n in r["held"]), (rank, r["case"])
            for name, h in r["held"].items():
                assert h["same"], (rank, r["case"], name, h)
                if ".shared_experts." in name:  # split over tp: 1/tp here, the whole over the tp group
                    assert h["fraction"] == 1 / r["tp"] and h["tp_total"] == h["whole"], (rank, r["case"], name, h)
                    assert h["split"] == (1 if name.endswith(".w2") else 0), (rank, r["case"], name, h)
                else:  # the router and the shared-expert gate: whole on every tp rank
                    assert h["fraction"] == 1 and h["split"] is None, (rank, r["case"], name, h)


def test_moe_model_at_tp2_sequence_parallel_equals_one_process() -> None:
    layouts = [dict(tp=2, etp=2), dict(tp=2, etp=1, ep=2), dict(tp=2, etp=1)]
    _check(run_on_ranks(_model_vs_single, 2, layouts, ["deepseek_tiny", "mixtral_tiny"], timeout=300))


@pytest.mark.slow
def test_moe_model_with_etp_other_than_tp_equals_one_process() -> None:
    """4 ranks, all of them tp (so the reference runs one batch): expert tp at 2 and 1 under tp=4, with the
    experts split over ep=2 or 4, or replicated over edp=2."""
    layouts = [dict(tp=4, etp=2, ep=2), dict(tp=4, etp=1, ep=4), dict(tp=4, etp=1, ep=2)]
    _check(run_on_ranks(_model_vs_single, 4, layouts, ["deepseek_tiny"], num_kv_heads=4, timeout=400))


def _gate_vs_single(rank: int, world: int) -> list[tuple[str, float]]:
    """A Qwen2-MoE-style layer (shared expert + its sigmoid gate) built by ``moe_mlp`` at tp=2 SP."""
    cfg = get_config("deepseek_tiny", moe=dict(aux_loss_coeff=0.05, z_loss_coeff=0.01))
    spec = cfg.spec.blocks[1]
    spec = dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, shared_expert_gate=True))
    checks = []
    for layout in (dict(tp=2, etp=2), dict(tp=2, etp=1, ep=2)):
        layers = []
        for pstate, sp in ((ParallelState(Topology(**layout)), True), (ParallelState.single_process(), False)):
            ctx = BuildContext(config=cfg, pstate=pstate, seed=9, sequence_parallel=sp, recompute="none",
                               dtype=torch.float64, device=torch.device("cpu"),
                               context_parallel=ContextParallelAttention.build(pstate, ContextParallelOptions()))
            layers.append((moe_mlp(ctx, 1, spec), pstate))
        (layer, pstate), (ref, _) = layers
        g = torch.Generator().manual_seed(2)
        x = torch.randn(B, S, cfg.hidden_size, generator=g, dtype=torch.float64)
        cot = torch.randn(B, S, cfg.hidden_size, generator=g, dtype=torch.float64)
        half = slice(pstate.coord("tp") * S // 2, (pstate.coord("tp") + 1) * S // 2)
        (layer(x[:, half].clone()) * cot[:, half]).sum().backward()
        (ref(x) * cot).sum().backward()
        assert layer.shared_expert_gate is not None
        checks += [(f"{layout} {k}", v) for k, v in _grad_errors(layer, ref, pstate).items()]
        pstate.destroy()
    return checks


def test_shared_expert_gate_gradient_at_tp2_equals_one_process() -> None:
    for rank, checks in enumerate(run_on_ranks(_gate_vs_single, 2, timeout=200)):
        bad = [(what, err) for what, err in checks if err > 1e-10]
        assert not bad and any("shared_expert_gate" in what for what, _ in checks), (rank, bad)


def _shared_expert_saved_bytes(rank: int, world: int) -> dict:
    """Bytes autograd keeps for backward in one tp=2 sequence-parallel shared-expert forward (the
    parameters and the layer input, counted elsewhere, left out), and the estimator's shared term."""
    from parallel3d.moe.shared_experts import SharedExpertFFN
    from parallel3d.planning.layout import Layout
    from parallel3d.planning.sequence_experts import moe_layer_activation_bytes

    cfg = get_config("deepseek_tiny")
    spec = cfg.spec.blocks[1]
    moe = spec.moe
    pstate = ParallelState(Topology(tp=world))
    ffn = SharedExpertFFN(cfg.hidden_size, moe.num_shared_experts * moe.shared_width, prefix="layers.1.mlp",
                          seed=3, pstate=pstate, sequence_parallel=True, kernel_backend="torch")
    x = torch.randn(B, S // world, cfg.hidden_size, requires_grad=True)
    skip = {x.untyped_storage().data_ptr()} | {p.untyped_storage().data_ptr() for p in ffn.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            kept[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = ffn(x)
    out.sum().backward()
    layout = Layout(tp=world, sequence_parallel=True, micro_batch_size=B, seq_len=S)
    no_shared = dataclasses.replace(spec, moe=dataclasses.replace(moe, num_shared_experts=0))
    # the CPU reference SwiGLU keeps gate, silu(gate) and up; the down projection keeps their product
    estimate = moe_layer_activation_bytes(spec, layout, 4, 4) - moe_layer_activation_bytes(no_shared, layout, 4, 4)
    pstate.destroy()
    return dict(measured=sum(kept.values()), estimated=estimate, out_shape=tuple(out.shape))


def test_shared_expert_activation_estimate_equals_what_autograd_keeps_at_tp2() -> None:
    """The memory estimator's shared-expert term (``planning.sequence_experts``) against the bytes autograd
    saves: every token of the sequence at 1/tp of the width, as for the dense MLP."""
    for rank, r in enumerate(run_on_ranks(_shared_expert_saved_bytes, 2, timeout=120)):
        assert r["out_shape"][1] == S // 2, (rank, r)
        assert r["measured"] > 0 and r["estimated"] == r["measured"], (rank, r)
