"""The MoE MLP of a block: ``parallel3d.moe.MoELayer`` on this rank's expert-grid groups.

``[b, s_local, h] -> [b, s_local, h]`` like the dense MLPs (``models.transformer.MLP_CLASSES``).
Groups: experts split over ``ep``, each expert's width over ``etp``; the ranks that split one
micro-batch (capacity drops and the per-micro-batch balancing losses are defined over them)
are ``tp_cp`` with sequence parallel, else ``cp``. The ep x etp ranks must hold different tokens,
so tp > 1 needs sequence parallel (``check_moe_layout`` refuses it otherwise, before any work).
Parameters (``layers.{i}.mlp.router.weight``, ``layers.{i}.mlp.experts.{e}.w1/w2/w3`` by global
expert index, ``layers.{i}.mlp.shared_experts.*``) depend only on (seed, global name).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from models.blocks import BuildContext
from models.spec import BlockSpec
from parallel3d.moe import MoELayer

if TYPE_CHECKING:  # pragma: no cover
    from parallel3d.parallel_state import ParallelState


def check_moe_layout(moe_enabled: bool, tp: int, sequence_parallel: bool) -> None:
    """Raise ValueError (one line) when the layout breaks the MoE token contract (module docstring)."""
    if moe_enabled and tp > 1:
        # Under sequence parallel the router and shared-expert weight gradients are partial sums over
        # tp that nothing all-reduces yet: refuse rather than train wrongly.
        raise ValueError(f"model.moe with parallel.tp={tp}: MoE models run at tp=1 for now (use ep and etp; "
                         "the router gradient is not yet summed over tp)")


def moe_token_group_kind(pstate: "ParallelState", sequence_parallel: bool) -> str:
    """The group kind whose ranks split one micro-batch's tokens."""
    return "tp_cp" if sequence_parallel and pstate.size("tp") > 1 else "cp"


def moe_mlp(ctx: BuildContext, layer: int, spec: BlockSpec) -> MoELayer:
    """Global layer ``layer``'s mixture of experts (``spec.moe``) as its ``mlp`` (module docstring)."""
    assert spec.moe is not None
    check_moe_layout(True, ctx.pstate.size("tp"), ctx.sequence_parallel)
    pstate = ctx.pstate
    return MoELayer(spec.moe, spec.hidden_size, global_name=f"layers.{layer}.mlp", seed=ctx.seed,
                    init_std=ctx.config.init_std, output_std=ctx.residual_std,
                    ep_group=pstate.group("ep"), etp_group=pstate.group("etp"),
                    token_group=pstate.group(moe_token_group_kind(pstate, ctx.sequence_parallel)),
                    dtype=ctx.dtype, device=ctx.device, kernel_backend=ctx.config.backend,
                    emulate_nccl=pstate.emulate_nccl, comm_stats=pstate.comm_stats)
