"""Load-balancing losses and the function that injects their gradient in backward.

Auxiliary loss (Switch / GShard): ``L_aux = E * sum_i f_i * P_i`` over a token set ``S``:
``f_i = (slots routed to expert i in S) / (|S| * k)`` (before any capacity drop) and
``P_i = mean over S of p_i``, where ``p`` are the per-token probabilities (softmax scores;
sigmoid scores divided by their sum). Balanced routing gives 1. The set ``S`` by scope:

- ``micro_batch``: the micro-batch's tokens of one data-parallel replica, i.e. all ranks of
  the *token group* (those that split one micro-batch: tp with sequence parallel, cp).
  Layout-independent at a given micro-batch *composition*: runs agree when their
  micro-batches hold the same sequences (equal micro-batch size), not otherwise;
- ``sequence`` (DeepSeek-V3's sequence-wise loss): each sequence is its own set and the
  loss is the mean over the micro-batch's sequences. Independent of the layout and of how
  sequences are grouped into micro-batches;
- ``global``: the tokens of all ranks in the *global group* at this micro-step (e.g. every
  data-parallel replica's current micro-batch). This is the one layout-dependent setting:
  its set changes with dp (and with the number of micro-batches), so it is kept out of the
  layout-equivalence matrix.

Router z-loss (ST-MoE): ``L_z = mean over the micro-batch of logsumexp(logits)^2``.

Each rank computes its *share*: the terms over its own tokens, with ``f_i`` and the set
sizes summed over the group first (one all-reduce of integer counts). The shares of a set
sum to the loss, and each rank's gradient is exactly the single-process gradient on its
tokens. The coefficients scale the sum ``coeff_aux * L_aux + coeff_z * L_z``, which never
joins the main loss tensor: ``inject_loss_gradient(out, loss, scale)`` returns ``out``
unchanged and, in backward, feeds ``scale`` as the gradient of ``loss`` (``scale`` = the
factor the trainer puts on each micro-batch's main loss, e.g. ``1/num_microbatches``). So
the losses enter backward inside the MoE layer: nothing crosses a pipeline stage, and the
pipeline size cannot change them. Their values are reported through ``parallel3d.moe.metrics``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from parallel3d.moe.collectives import all_reduce_sum
from parallel3d.moe.options import MoEOptions
from parallel3d.moe.router import Routing


@dataclass
class BalanceTerms:
    """This rank's shares (scalars): ``aux``/``z`` carry the graph (None when the coefficient is 0 and
    the value is not asked for); ``weighted`` = ``coeff_aux * aux + coeff_z * z`` (None if both
    coefficients are 0); ``token_share`` = this rank's tokens / the set's tokens."""

    aux: torch.Tensor | None
    z: torch.Tensor | None
    weighted: torch.Tensor | None
    token_share: torch.Tensor


def expert_counts(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[..., k]`` expert ids -> ``[E]`` int64 slot counts."""
    return torch.bincount(indices.reshape(-1), minlength=num_experts)


def switch_aux_loss(probs: torch.Tensor, counts: torch.Tensor, set_tokens: torch.Tensor, top_k: int) -> torch.Tensor:
    """Share of ``E * sum_i f_i P_i`` from local ``probs [T, E]`` given the set's ``counts [E]`` and size."""
    num_experts = probs.shape[-1]
    f = counts.to(probs.dtype) / (set_tokens * top_k)
    return num_experts * (f * probs.sum(0)).sum() / set_tokens


def sequence_aux_loss(probs: torch.Tensor, counts: torch.Tensor, seq_tokens: torch.Tensor, top_k: int) -> torch.Tensor:
    """Share of the mean over sequences: ``probs [b, s_local, E]``, ``counts [b, E]`` per whole sequence."""
    b, _, num_experts = probs.shape
    f = counts.to(probs.dtype) / (seq_tokens * top_k)
    return num_experts * (f * probs.sum(1)).sum() / (seq_tokens * max(b, 1))


def router_z_loss(logits: torch.Tensor, set_tokens: torch.Tensor) -> torch.Tensor:
    """Share of ``mean logsumexp(logits)^2`` from local ``logits [T, E]`` over a set of ``set_tokens``."""
    return torch.logsumexp(logits, dim=-1).square().sum() / set_tokens


def balance_terms(routing: Routing, options: MoEOptions, batch: int, seq: int, *,
                  token_group: "dist.ProcessGroup | None", global_group: "dist.ProcessGroup | None" = None,
                  want_values: bool = True) -> BalanceTerms:
    """This rank's loss shares for ``routing`` of ``batch * seq`` tokens (batch-major; ``seq`` local).

    ``token_group``: the ranks splitting this micro-batch (micro-batch and sequence scopes,
    and the z-loss); ``global_group``: the pooled set of the ``global`` scope.
    ``want_values``: compute a loss whose coefficient is 0 anyway (for metrics).
    """
    o = options
    tokens = routing.indices.shape[0]
    aux = z = None
    local_t = torch.tensor([tokens], dtype=torch.int64, device=routing.indices.device)
    need_aux = o.aux_loss_coeff > 0 or want_values
    if o.aux_loss_scope == "sequence":
        per_seq = routing.indices.view(batch, seq, o.top_k)
        seq_ids = torch.arange(batch, device=per_seq.device).view(batch, 1, 1) * o.num_experts
        counts = torch.bincount((per_seq + seq_ids).reshape(-1), minlength=batch * o.num_experts)
        packed = all_reduce_sum(torch.cat([counts, local_t]), token_group, kind="moe_token")
        set_tokens = packed[-1].to(routing.logits.dtype).clamp_min(1)  # an empty set contributes nothing
        seq_tokens = set_tokens / max(batch, 1)
        if need_aux:
            probs = routing.balance_scores(o.score_function).view(batch, seq, o.num_experts)
            aux = sequence_aux_loss(probs, packed[:-1].view(batch, o.num_experts), seq_tokens, o.top_k)
    else:
        group = global_group if o.aux_loss_scope == "global" else token_group
        counts = expert_counts(routing.indices, o.num_experts)
        packed = all_reduce_sum(torch.cat([counts, local_t]), group, kind="moe_token")
        pooled_tokens = packed[-1].to(routing.logits.dtype).clamp_min(1)
        if need_aux:
            aux = switch_aux_loss(routing.balance_scores(o.score_function), packed[:-1], pooled_tokens, o.top_k)
        set_tokens = pooled_tokens
        if o.aux_loss_scope == "global" and (o.z_loss_coeff > 0 or want_values):
            set_tokens = all_reduce_sum(local_t, token_group, kind="moe_token")[0].to(routing.logits.dtype).clamp_min(1)
    if o.z_loss_coeff > 0 or want_values:
        z = router_z_loss(routing.logits, set_tokens)
    weighted = None
    for coeff, term in ((o.aux_loss_coeff, aux), (o.z_loss_coeff, z)):
        if coeff > 0 and term is not None:
            weighted = coeff * term if weighted is None else weighted + coeff * term
    return BalanceTerms(aux, z, weighted, tokens / set_tokens)


class _InjectLossGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, loss, scale, on_backward):  # type: ignore[override]
        ctx.scale, ctx.on_backward, ctx.has_loss = scale, on_backward, loss is not None
        ctx.loss_dtype = loss.dtype if loss is not None else None
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if ctx.on_backward is not None:
            ctx.on_backward()
        grad_loss = torch.full((), ctx.scale, dtype=ctx.loss_dtype, device=grad.device) if ctx.has_loss else None
        return grad, grad_loss, None, None


def inject_loss_gradient(out: torch.Tensor, loss: torch.Tensor | None, scale: float,
                         on_backward: Callable[[], None] | None = None) -> torch.Tensor:
    """``out`` unchanged; in backward, ``scale`` flows into ``loss`` (scalar) and ``on_backward()`` runs once.

    The backward of this node runs exactly once per micro-batch even with activation
    recompute (which re-runs forwards, not this node's backward), so ``on_backward`` is
    where per-step statistics are counted.
    """
    return _InjectLossGradient.apply(out, loss, scale, on_backward)
