"""Capacity drops with the micro-batch split over tp (sequence parallel) and cp: equal to one process.

The drop definition (``parallel3d.moe.capacity``) ranks each expert's slots over the whole
micro-batch by layout-independent keys: the router score (``probs``) or the token's place in the
micro-batch, ``row * 2**32 + global position`` (``position``). The model passes each rank's global
positions (``models.moe_block.sequence_positions``: the cp share's load-balanced chunks ``r`` and
``2cp-1-r``, then the sequence-parallel slice), so the kept slots, the loss and every gradient equal
the single process's on the same micro-batches.

Each rank builds the MoE model in float64 at a layout (tp2+sp with etp 2 or ep 2, cp2 with ep 1 or 2;
slow: tp2 x cp2, cp2 x dp2 with ep 4 folded over dp), capacity factor 0.5 (drops certain: at most
half the slots fit) and either policy, and runs its share of the batch. The reference is the same
model (layout-independent init) built with ``ParallelState.single_process()`` on every rank, run on
each data-parallel micro-batch whole. Checked:

- the loss (mean over dp x cp: each cp rank's loss is cp times its token share; the aux / z
  gradients get the same factor, as the trainer sets it);
- every gradient: dense ones averaged over dp x cp, tp-split ones against the reference's slice,
  expert ones summed over their replicas (edp) / (dp x cp) against the etp slice;
- the dropped slots of every MoE layer summed over the ranks equal the reference's, and are > 0.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from models import build_model, get_config
from parallel3d.context_parallel import shift_labels, split_for_cp
from parallel3d.moe import MoELayer
from parallel3d.parallel_state import ParallelState
from parallel3d.param_meta import tp_split_dim
from parallel3d.topology import Topology
from tests.harness import run_on_ranks

B, S = 2, 16  # per micro-batch; S divides 2 * cp * tp for every layout below
TOL = 1e-6  # tp=1 computes the loss in float32 (kernels.dispatch), as in tests/test_moe_tp.py
CAPACITY = 0.5
POLICIES = ("probs", "position")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _batch(micro_batches: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 500, (micro_batches * B, S), generator=g)
    labels = shift_labels(tokens)
    labels[:, -1] = 1  # a target for every token
    return tokens, labels


def _dropped(model: torch.nn.Module) -> torch.Tensor:
    """``[moe layers]`` dropped slots recorded by the last backward (float64)."""
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    return torch.stack([m.stats.values[m.options.num_experts].clone() for m in layers])


def _set_aux_loss_scale(model: torch.nn.Module, scale: float) -> None:
    """What the trainer does (``parallel3d.moe_step``): the aux / z gradients get the main loss's factor."""
    for m in model.modules():
        if isinstance(m, MoELayer):
            m.aux_loss_scale = scale


def _reduce(t: torch.Tensor, pstate: ParallelState, kind: str) -> torch.Tensor:
    t, group = t.clone(), pstate.group(kind)
    if group is not None:  # None: a group of one
        dist.all_reduce(t, group=group)
    return t


def _on_rank(rank: int, world: int, layouts: list[dict], models: list[str], capacity: float = CAPACITY) -> list[dict]:
    out = []
    for layout in layouts:
        pstate = ParallelState(Topology(**layout))
        dp, cp, dp_rank, cp_rank = pstate.size("dp"), pstate.size("cp"), pstate.coord("dp"), pstate.coord("cp")
        tokens, labels = _batch(dp)
        rows = slice(dp_rank * B, (dp_rank + 1) * B)
        sp = pstate.size("tp") > 1
        for name in models:
            for policy in POLICIES:
                cfg = get_config(name, moe=dict(capacity_factor=capacity, drop_policy=policy, aux_loss_coeff=0.05,
                                                z_loss_coeff=0.01))
                model = build_model(cfg, pstate, seed=3, dtype=torch.float64, sequence_parallel=sp)
                _set_aux_loss_scale(model, cp)
                loss = model(split_for_cp(tokens[rows], cp, cp_rank), labels=split_for_cp(labels[rows], cp, cp_rank))
                loss.backward()
                ref = build_model(cfg, ParallelState.single_process(), seed=3, dtype=torch.float64)
                _set_aux_loss_scale(ref, 1 / dp)
                ref_dropped = torch.zeros(())
                ref_loss = torch.zeros((), dtype=torch.float64)
                for mb in range(dp):  # the reference's micro-batches are the dp ranks' ones
                    mb_rows = slice(mb * B, (mb + 1) * B)
                    mb_loss = ref(tokens[mb_rows], labels=labels[mb_rows]) / dp
                    mb_loss.backward()
                    ref_loss = ref_loss + mb_loss.detach()
                    ref_dropped = ref_dropped + _dropped(ref)
                    for m in ref.modules():
                        if isinstance(m, MoELayer):
                            m.stats.reset()
                dropped = _reduce(_dropped(model), pstate, "world")
                errors = _grad_errors(model, ref, pstate)
                worst = max(errors, key=errors.get)
                out.append(dict(case=f"{name} {layout} {policy}",
                                loss=_rel(_reduce(loss.detach(), pstate, "dp_cp") / (dp * cp), ref_loss),
                                worst=worst, grads=errors[worst], dropped=dropped.tolist(),
                                ref_dropped=ref_dropped.tolist()))
        pstate.destroy()
    return out


def _grad_errors(model: torch.nn.Module, ref: torch.nn.Module, pstate: ParallelState) -> dict[str, float]:
    """Each parameter's gradient error against the reference's (module docstring)."""
    ref_grads = {p.global_name: p.grad for p in ref.parameters()}
    replicas = pstate.size("dp") * pstate.size("cp")
    out = {}
    for p in model.parameters():
        name, want = p.global_name, ref_grads[p.global_name]
        if getattr(p, "expert_index", None) is not None:
            grad = _reduce(p.grad, pstate, "edp") / replicas
            want = want.chunk(pstate.size("etp"), p.etp_split_dim)[pstate.coord("etp")]
        else:
            grad = _reduce(p.grad, pstate, "dp_cp") / replicas
            dim = tp_split_dim(p)
            if dim is not None:
                want = want.narrow(dim, pstate.coord("tp") * p.shape[dim], p.shape[dim])
        out[name] = _rel(grad, want)
    return out


def _check(results: list[list[dict]]) -> None:
    for rank, rows in enumerate(results):
        for r in rows:
            assert r["dropped"] == r["ref_dropped"] and min(r["ref_dropped"]) > 0, (rank, r)
            assert r["loss"] < TOL and r["grads"] < TOL, (rank, r)


def test_capacity_drops_at_tp2_sequence_parallel_and_cp2_equal_one_process() -> None:
    layouts = [dict(tp=2, etp=2), dict(tp=2, etp=1, ep=2), dict(cp=2), dict(cp=2, ep=2)]
    _check(run_on_ranks(_on_rank, 2, layouts, ["mixtral_tiny", "deepseek_tiny"], timeout=400))


@pytest.mark.slow
def test_capacity_drops_at_tp2_cp2_and_with_ep_folded_over_dp_equal_one_process() -> None:
    layouts = [dict(tp=2, cp=2, etp=1, ep=2), dict(cp=2, dp=2, ep=4)]
    _check(run_on_ranks(_on_rank, 4, layouts, ["mixtral_tiny"], timeout=500))

