"""The MoE layer: router + capacity + dispatcher + experts (+ shared experts) + balancing losses.

``MoELayer(x [b, s, h]) -> [b, s, h]`` where ``s`` is whatever this rank holds of the
sequence (``s / tp`` under sequence parallel, ``s / cp`` under context parallel).

Groups (``ProcessGroup`` or None for one rank; the integrator passes the expert grid's):
``ep_group`` (experts split over it), ``etp_group`` (each expert's width split over it),
``token_group`` (the ranks that split one micro-batch: tp with sequence parallel x cp;
capacity drops and the micro-batch / sequence losses are defined over it) and
``global_group`` (only for ``aux_loss_scope="global"``; None pools this rank's tokens alone).
Contract: every rank of the ep x etp grid holds different tokens (with tp > 1 that means sequence parallel, or the
caller scatters the sequence over tp around this layer).

Forward: route (fp32) -> capacity mask over the token group (if ``capacity_factor``) ->
dispatch -> experts -> combine weighted by the routing weights (+ shared experts, optionally
gated) -> ``inject_loss_gradient`` attaches the aux / z losses (their gradient, times
``aux_loss_scale``, is fed in this layer's backward; nothing joins the main loss) and
counts the step statistics in backward. ``token_ids`` ``[b, s]`` (int64, unique within the
micro-batch, the same in every layout, e.g. ``sequence * 2**32 + position``) are needed
for capacity when the token group has more than one rank: given per call, or built from
``token_positions`` (the constructor's ``s_local -> [s_local]`` global positions of this rank's
tokens in their sequence, e.g. the cp share's chunks then the sequence-parallel slice) as
``row * 2**32 + position``; by default the local ``(sequence, position)`` order is used.

Parameters (``global_name`` e.g. ``layers.3.mlp``): ``router.weight``, ``router.expert_bias``
(buffer), ``experts.{e}.w1/w2/w3`` by global expert index, ``shared_experts.w1/w2/w3``,
``shared_expert_gate.weight``. Init depends only on (seed, global name).
Gradient reduction the integrator owns: expert parameters are SUMMED over the expert
data-parallel group and divided like dense gradients (by dp x cp, not by the edp size);
the router and the shared-expert gate are dense replicated parameters; the shared experts are
whatever module the integrator passes (``shared_experts``: split over tp like the dense MLP in
``models.moe_block``, or a whole ``SharedExpertFFN``). Where the ranks of a dense-replica group
hold different tokens (tp under sequence parallel), the replicated weights' gradients are partial
sums over that group: ``replicated_weight_fn`` (applied to the router and gate weights at every use;
e.g. identity forward, all-reduce of the gradient over tp) completes them; this module knows only
the function, not the group.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from parallel3d.moe.capacity import capacity_keep_mask
from parallel3d.moe.collectives import ByteCounter, group_size
from parallel3d.moe.dispatcher_allgather import AllGatherDispatcher
from parallel3d.moe.dispatcher_alltoall import AllToAllDispatcher
from parallel3d.moe.expert_layout import ExpertLayout
from parallel3d.moe.experts import GroupedExperts
from parallel3d.moe.load_balance import balance_terms, expert_counts, inject_loss_gradient
from parallel3d.moe.metrics import MoEStepStats
from parallel3d.moe.options import MoEOptions
from parallel3d.moe.router import TopKRouter
from parallel3d.moe.shared_experts import SharedExpertFFN, SharedExpertGate

ProcessGroup = "dist.ProcessGroup | None"


class MoELayer(nn.Module):
    """See the module docstring."""

    def __init__(self, options: MoEOptions, hidden: int, *, global_name: str, seed: int = 0,
                 init_std: float = 0.02, output_std: float | None = None,
                 ep_group: "dist.ProcessGroup | None" = None, etp_group: "dist.ProcessGroup | None" = None,
                 token_group: "dist.ProcessGroup | None" = None, global_group: "dist.ProcessGroup | None" = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 kernel_backend: str = "auto", emulate_nccl: bool = False, comm_stats: ByteCounter | None = None,
                 shared_experts: nn.Module | None = None,
                 replicated_weight_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 token_positions: Callable[[int, torch.device], torch.Tensor] | None = None) -> None:
        super().__init__()
        o = options
        if o.pad_to_capacity and o.dispatcher != "alltoall":
            raise ValueError(
                f"moe.pad_to_capacity=True: allowed only with dispatcher='alltoall' (got {o.dispatcher!r})")
        self.options, self.global_name = o, global_name
        self.token_group, self.global_group = token_group, global_group
        self.token_positions = token_positions
        layout = ExpertLayout(o.num_experts, ep_group, etp_group)
        out_std = init_std if output_std is None else output_std
        self.router = TopKRouter(o, hidden, global_name=f"{global_name}.router", seed=seed, init_std=init_std,
                                 dtype=dtype, device=device, weight_fn=replicated_weight_fn)
        self.experts = GroupedExperts(o.num_experts, hidden, o.ffn_hidden, first=layout.first_expert,
                                      num_local=layout.local_experts, prefix=global_name, seed=seed,
                                      init_std=init_std, output_std=out_std, etp_rank=layout.etp_rank,
                                      etp_size=layout.etp, dtype=dtype, device=device,
                                      gemm_backend=o.gemm_backend, kernel_backend=kernel_backend)
        if shared_experts is None and o.num_shared_experts:
            shared_experts = SharedExpertFFN(hidden, o.num_shared_experts * o.shared_width, prefix=global_name,
                                             seed=seed, init_std=init_std, output_std=out_std, dtype=dtype,
                                             device=device, kernel_backend=kernel_backend,
                                             weight_fn=replicated_weight_fn)
        self.shared_experts = shared_experts
        self.shared_expert_gate = (SharedExpertGate(hidden, prefix=global_name, seed=seed, init_std=init_std,
                                                    dtype=dtype, device=device, weight_fn=replicated_weight_fn)
                                   if o.shared_expert_gate else None)
        if o.dispatcher == "alltoall":
            self.dispatcher: AllToAllDispatcher | AllGatherDispatcher = AllToAllDispatcher(
                o.num_experts, ep_group, etp_group, pad_to_capacity=o.pad_to_capacity, emulate_nccl=emulate_nccl,
                comm_stats=comm_stats)
        else:
            self.dispatcher = AllGatherDispatcher(o.num_experts, ep_group, etp_group, comm_stats=comm_stats)
        self.stats = MoEStepStats(o.num_experts, device)
        self.aux_loss_scale = 1.0  # the factor the trainer puts on each micro-batch's main loss

    def token_ids_for(self, b: int, s: int, token_ids: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        """``[b * s]`` int64 ids for capacity ranking: ``token_ids`` flattened, else ``row * 2**32 + position``
        with ``token_positions`` (or the local order, only where this rank holds the whole micro-batch)."""
        if token_ids is not None:
            return token_ids.reshape(-1).to(device=device, dtype=torch.int64)
        if self.token_positions is not None:
            positions = self.token_positions(s, device).to(device=device, dtype=torch.int64)
        elif group_size(self.token_group) > 1:
            raise ValueError("MoELayer: capacity over a token group of several ranks needs token_ids [b, s] "
                             "or token_positions")
        else:
            positions = torch.arange(s, device=device)
        seq = torch.arange(b, device=device).view(b, 1) * (1 << 32)
        return (seq + positions.view(1, s)).reshape(-1)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        o = self.options
        b, s, h = x.shape
        tokens = x.reshape(b * s, h)
        routing = self.router(tokens)
        keep, capacity = None, None
        if o.capacity_factor is not None:
            keep, capacity = capacity_keep_mask(
                routing.indices, routing.selected_scores, self.token_ids_for(b, s, token_ids, x.device),
                num_experts=o.num_experts, capacity_factor=o.capacity_factor, policy=o.drop_policy,
                token_group=self.token_group, syncs=self.dispatcher.host_syncs)
        terms = balance_terms(routing, o, b, s, token_group=self.token_group, global_group=self.global_group)
        weights = routing.weights if keep is None else routing.weights * keep
        dispatched = self.dispatcher.dispatch(tokens, routing.indices, keep, capacity)
        expert_out = self.experts(dispatched.rows, dispatched.sizes)
        out = self.dispatcher.combine(expert_out, dispatched, weights)
        if self.shared_experts is not None:
            shared = self.shared_experts(tokens)
            if self.shared_expert_gate is not None:
                shared = shared * self.shared_expert_gate(tokens)
            out = out + shared
        counts = expert_counts(routing.indices, o.num_experts)
        dropped = torch.zeros((), device=x.device) if keep is None else (~keep).sum()
        routed = routing.indices.numel()

        def record() -> None:
            self.stats.record(counts, dropped, routed, terms.aux, terms.z, terms.token_share)

        out = inject_loss_gradient(out, terms.weighted, self.aux_loss_scale, record)
        return out.view(b, s, h)
