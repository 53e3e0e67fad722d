"""Sequence-parallel entry to column-parallel layers: all-gather + linear, saving only the shard.

Under sequence parallelism a column-parallel layer's input arrives as this rank's
sequence chunk ``[b, s/n, h]`` and is all-gathered to ``[b, s, h]`` before the matmul.
Letting autograd save the gathered input for the weight gradient would keep ``n`` times
the activation memory Korthikanti et al. (2022, section 4.2.2) count for it; this
function saves the shard and all-gathers it again in backward, where the weight
gradient needs the whole sequence. The gradient of the input is reduce-scattered back
to the sequence chunk (the transpose of the gather).

Several layers reading the same input (SwiGLU's gate and up) share one gather in
forward and one gather + one reduce-scatter in backward. In a zero-bubble ``B`` the
weight gradients (and the gather they need) are deferred to ``W``
(``parallel3d.deferred_grads``): ``B`` then only reduce-scatters the input gradient. All collectives run on the
``tp`` group through ``parallel3d.tensor_parallel.mappings`` (a group of one: identity).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch
import torch.nn.functional as F

from parallel3d.tensor_parallel import mappings
from parallel3d.tensor_parallel.deferrable_linear import linear_weight_grads

if TYPE_CHECKING:  # pragma: no cover
    from parallel3d.parallel_state import ParallelState

WeightAndBias = tuple[torch.Tensor, "torch.Tensor | None"]


class _SeqGatheredLinears(torch.autograd.Function):
    """``[F.linear(gather_seq(x), w_i, b_i) for i]``; saves ``x`` (the shard) and the weights."""

    @staticmethod
    def forward(ctx, x, pstate, *weights_and_biases):  # type: ignore[override]
        weights, biases = weights_and_biases[0::2], weights_and_biases[1::2]
        ctx.pstate = pstate
        ctx.save_for_backward(x, *weights)
        ctx.params = weights_and_biases  # for their marks and gradient edges (deferrable_linear)
        x_full = mappings.all_gather_along_dim(x, mappings.SEQ_DIM, pstate)
        return tuple(F.linear(x_full, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        x, *weights = ctx.saved_tensors
        pstate = ctx.pstate
        needs = ctx.needs_input_grad

        def weight_grads() -> list[torch.Tensor | None]:
            """The weight gradients need the whole sequence: all-gather the saved shard again."""
            x_full = mappings.all_gather_along_dim(x, mappings.SEQ_DIM, pstate)
            out: list[torch.Tensor | None] = []
            for i, grad in enumerate(grads):
                out.extend(linear_weight_grads(x_full, grad, needs[2 + 2 * i], needs[3 + 2 * i]))
            return out

        deferred = pstate.weight_grads.defer(ctx.params, weight_grads, (x, *grads))
        param_grads = [None] * len(ctx.params) if deferred else weight_grads()
        grad_x = None
        if needs[0]:
            grad_x_full = grads[0].matmul(weights[0])
            for grad, weight in zip(grads[1:], weights[1:]):
                grad_x_full = grad_x_full + grad.matmul(weight)
            grad_x = mappings.reduce_scatter_along_dim(grad_x_full, mappings.SEQ_DIM, pstate)
        return (grad_x, None, *param_grads)


def seq_gathered_linears(
    x: torch.Tensor, weights_and_biases: Sequence[WeightAndBias], pstate: "ParallelState"
) -> list[torch.Tensor]:
    """``x`` ``[b, s/n, h]`` (this rank's sequence chunk) -> ``[x_full @ w.T + b for (w, b)]``,
    each ``[b, s, out_local]``; keeps only ``x``'s chunk for backward (see module docstring)."""
    flat = [t for pair in weights_and_biases for t in pair]
    return list(_SeqGatheredLinears.apply(x, pstate, *flat))
