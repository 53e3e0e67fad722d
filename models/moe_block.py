"""The MoE MLP of a block: ``parallel3d.moe.MoELayer`` on this rank's expert-grid groups.

``[b, s_local, h] -> [b, s_local, h]`` like the dense MLPs (``models.transformer.MLP_CLASSES``).
Groups: experts split over ``ep``, each expert's width over ``etp``; the ranks that split one
micro-batch (capacity drops and the per-micro-batch balancing losses are defined over them)
are ``tp_cp`` with sequence parallel, else ``cp``. The ep x etp ranks must hold different tokens,
so tp > 1 needs sequence parallel (``check_moe_layout`` refuses it otherwise, before any work).
Under sequence parallel each tp rank routes only its own chunk of the sequence, so the router's
and shared-expert gate's weight gradients are partial sums over tp: as for the norms
(``models.blocks.Norm``), ``copy_to_tp_region`` is applied to them at use time (identity
forward, all-reduce of the gradient over tp in backward). The shared experts are split over tp
like the dense SwiGLU MLP (``parallel3d.moe.shared_experts``: column-parallel in, row-parallel out,
sequence-parallel gather / reduce-scatter around them). Expert gradients need no such step:
tokens meet their experts through the dispatcher, and the experts' replicas (``edp``) are summed.
Capacity drops rank a whole micro-batch's tokens by layout-independent ids (``parallel3d.moe.capacity``):
each rank's tokens carry their global sequence positions (``sequence_positions``: the cp share's two
load-balanced chunks, then this tp rank's sequence-parallel slice of it), so the drops equal one process's.
Parameters (``layers.{i}.mlp.router.weight``, ``layers.{i}.mlp.experts.{e}.w1/w2/w3`` by global
expert index, ``layers.{i}.mlp.shared_experts.*``) depend only on (seed, global name).
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch

from models.blocks import BuildContext
from models.spec import BlockSpec
from parallel3d.context_parallel.load_balance import local_positions
from parallel3d.moe import MoELayer
from parallel3d.moe.expert_layout import check_expert_count
from parallel3d.moe.experts import check_expert_width
from parallel3d.moe.options import MoEOptions
from parallel3d.moe.shared_experts import SharedExpertFFN, check_shared_width
from parallel3d.tensor_parallel import copy_to_tp_region
from parallel3d.tensor_parallel.mappings import tp_chunk_start

if TYPE_CHECKING:  # pragma: no cover
    from parallel3d.parallel_state import ParallelState


def check_moe_layout(moe_enabled: bool, tp: int, sequence_parallel: bool) -> None:
    """Raise ValueError (one line) when the layout breaks the MoE token contract (module docstring).

    Capacity needs no rule of its own: drops are decided over the micro-batch at any tp (sequence
    parallel) x cp."""
    if moe_enabled and tp > 1 and not sequence_parallel:
        # Without it every tp rank holds the same tokens: the expert-parallel exchange would count them tp times.
        raise ValueError(f"model.moe with parallel.tp={tp}: needs parallel.sequence_parallel=true "
                         "(the expert-parallel ranks must hold different tokens)")


def check_expert_degrees_need_moe(moe_enabled: bool, ep: int, etp: int | None, tp: int) -> None:
    """``parallel.ep`` / ``parallel.etp`` split routed experts: on a dense model they would be accepted and do
    nothing (ep would silently fold into dp), so asking for them there is a ValueError (one line); an etp
    equal to tp is what null means, so it passes."""
    if moe_enabled:
        return
    for key, value, unset in (("parallel.ep", ep, ep == 1), ("parallel.etp", etp, etp is None or etp == tp)):
        if not unset:
            raise ValueError(f"{key}={value}: splits the routed experts of a mixture-of-experts model, and this "
                             f"model has none (model.moe.num_experts=0): leave {key} at its default or pick a "
                             f"model with model.moe (e.g. model=mixtral_tiny)")


def check_moe_split(moe: MoEOptions, tp: int, ep: int, etp: int) -> None:
    """The experts split over ep, their widths over etp and the shared experts' over tp (ValueError, one
    line): the layers' own checks, asked before any rank starts."""
    check_expert_count(moe.num_experts, ep)
    check_expert_width(moe.ffn_hidden, etp)
    if moe.num_shared_experts:
        check_shared_width(moe.num_shared_experts * moe.shared_width, tp)


def sequence_positions(pstate: "ParallelState", sequence_parallel: bool, s_local: int,
                       device: torch.device) -> torch.Tensor:
    """``[s_local]`` global positions (in the whole sequence) of the tokens this rank's MoE layer sees."""
    tp = pstate.size("tp") if sequence_parallel else 1
    cp = pstate.size("cp")
    positions = local_positions(s_local * tp * cp, cp, pstate.coord("cp"), device=device) if cp > 1 \
        else torch.arange(s_local * tp, device=device)
    start = tp_chunk_start(s_local, pstate) if tp > 1 else 0
    return positions[start:start + s_local]


def moe_token_group_kind(pstate: "ParallelState", sequence_parallel: bool) -> str:
    """The group kind whose ranks split one micro-batch's tokens."""
    return "tp_cp" if sequence_parallel and pstate.size("tp") > 1 else "cp"


def moe_mlp(ctx: BuildContext, layer: int, spec: BlockSpec) -> MoELayer:
    """Global layer ``layer``'s mixture of experts (``spec.moe``) as its ``mlp`` (module docstring)."""
    assert spec.moe is not None
    check_moe_layout(True, ctx.pstate.size("tp"), ctx.sequence_parallel)
    pstate = ctx.pstate
    split_over_tp = ctx.sequence_parallel and pstate.size("tp") > 1
    moe, name = spec.moe, f"layers.{layer}.mlp"
    shared = None
    if moe.num_shared_experts:
        shared = SharedExpertFFN(spec.hidden_size, moe.num_shared_experts * moe.shared_width, prefix=name,
                                 seed=ctx.seed, init_std=ctx.config.init_std, output_std=ctx.residual_std,
                                 dtype=ctx.dtype, device=ctx.device, kernel_backend=ctx.config.backend,
                                 pstate=pstate, sequence_parallel=ctx.sequence_parallel)
    return MoELayer(moe, spec.hidden_size, global_name=name, seed=ctx.seed,
                    init_std=ctx.config.init_std, output_std=ctx.residual_std,
                    ep_group=pstate.group("ep"), etp_group=pstate.group("etp"),
                    token_group=pstate.group(moe_token_group_kind(pstate, ctx.sequence_parallel)),
                    dtype=ctx.dtype, device=ctx.device, kernel_backend=ctx.config.backend,
                    emulate_nccl=pstate.emulate_nccl, comm_stats=pstate.comm_stats, shared_experts=shared,
                    replicated_weight_fn=partial(copy_to_tp_region, pstate=pstate) if split_over_tp else None,
                    token_positions=partial(sequence_positions, pstate, ctx.sequence_parallel))
