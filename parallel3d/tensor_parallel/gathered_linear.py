"""Sequence-parallel entry to column-parallel layers: all-gather + linear, saving only the shard.

Under sequence parallelism a column-parallel layer's input arrives as this rank's
sequence chunk ``[b, s/n, h]`` and is all-gathered to ``[b, s, h]`` before the matmul.
Letting autograd save the gathered input for the weight gradient would keep ``n`` times
the activation memory Korthikanti et al. (2022, section 4.2.2) count for it; this
function saves the shard and all-gathers it again in backward, where the weight
gradient needs the whole sequence. The gradient of the input is reduce-scattered back
to the sequence chunk (the transpose of the gather).

Several layers reading the same input (SwiGLU's gate and up) share one gather in
forward and one gather + one reduce-scatter in backward. All collectives run on the
``tp`` group through ``parallel3d.tensor_parallel.mappings`` (a group of one: identity).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch
import torch.nn.functional as F

from parallel3d.tensor_parallel import mappings

if TYPE_CHECKING:  # pragma: no cover
    from parallel3d.parallel_state import ParallelState

WeightAndBias = tuple[torch.Tensor, "torch.Tensor | None"]


class _SeqGatheredLinears(torch.autograd.Function):
    """``[F.linear(gather_seq(x), w_i, b_i) for i]``; saves ``x`` (the shard) and the weights."""

    @staticmethod
    def forward(ctx, x, pstate, *weights_and_biases):  # type: ignore[override]
        weights, biases = weights_and_biases[0::2], weights_and_biases[1::2]
        ctx.pstate = pstate
        ctx.has_bias = [b is not None for b in biases]
        ctx.save_for_backward(x, *weights)
        x_full = mappings.all_gather_along_dim(x, mappings.SEQ_DIM, pstate)
        return tuple(F.linear(x_full, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        x, *weights = ctx.saved_tensors
        pstate = ctx.pstate
        needs = ctx.needs_input_grad
        x_full = mappings.all_gather_along_dim(x, mappings.SEQ_DIM, pstate)
        x_rows = x_full.reshape(-1, x_full.shape[-1])
        grad_x_full = None
        param_grads: list[torch.Tensor | None] = []
        for i, (grad, weight, has_bias) in enumerate(zip(grads, weights, ctx.has_bias)):
            if needs[0]:
                part = grad.matmul(weight)
                grad_x_full = part if grad_x_full is None else grad_x_full + part
            grad_rows = grad.reshape(-1, grad.shape[-1])
            param_grads.append(grad_rows.t().mm(x_rows) if needs[2 + 2 * i] else None)
            param_grads.append(grad_rows.sum(0) if has_bias and needs[3 + 2 * i] else None)
        grad_x = None
        if grad_x_full is not None:
            grad_x = mappings.reduce_scatter_along_dim(grad_x_full, mappings.SEQ_DIM, pstate)
        return (grad_x, None, *param_grads)


def seq_gathered_linears(
    x: torch.Tensor, weights_and_biases: Sequence[WeightAndBias], pstate: "ParallelState"
) -> list[torch.Tensor]:
    """``x`` ``[b, s/n, h]`` (this rank's sequence chunk) -> ``[x_full @ w.T + b for (w, b)]``,
    each ``[b, s, out_local]``; keeps only ``x``'s chunk for backward (see module docstring)."""
    flat = [t for pair in weights_and_biases for t in pair]
    return list(_SeqGatheredLinears.apply(x, pstate, *flat))
