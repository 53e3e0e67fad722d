"""Dropout whose masks do not depend on the parallel layout.

Invariant: the mask of batch row ``i`` at ``(seed, step, sample_ids[i], layer, site)`` is the
same whatever the tp / pp / dp layout or micro-batch size. Each row's full-sequence mask
``[s, h]`` is drawn from a generator on the activations' device seeded by a stable hash of
those values (so masks agree between layouts on the same device type); with sequence
parallel a rank keeps the rows of its sequence chunk; with context parallel, of its cp
share (``context_parallel.split_for_cp``) first. Costs one generator per
row and call, which is why everything is skipped when ``p == 0``. Backward keeps the bool mask
(1 byte an element, as ``planning.activations`` counts it). On the meta device (the dry run) the
mask is only a shape.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from parallel3d.context_parallel.load_balance import split_for_cp
from parallel3d.tensor_parallel.init import stable_seed
from parallel3d.tensor_parallel.mappings import tp_chunk_start, tp_group_size

if TYPE_CHECKING:  # pragma: no cover
    from parallel3d.parallel_state import ParallelState


def layout_independent_dropout(
    x: torch.Tensor,
    p: float,
    *,
    seed: int,
    step: int,
    sample_ids: torch.Tensor,
    layer: int,
    site: str,
    pstate: "ParallelState",
    sequence_parallel: bool = False,
) -> torch.Tensor:
    """Dropout of ``x [b, s_local, h]`` (``s_local = s/cp``, ``/tp`` with sequence parallel)."""
    if p == 0.0:
        return x
    b, s_local, h = x.shape
    n = tp_group_size(pstate) if sequence_parallel else 1
    cp = pstate.size("cp") if pstate.distributed else 1
    start = tp_chunk_start(s_local, pstate) if sequence_parallel else 0
    if x.device.type == "meta":  # the dry run: no generator, no sample ids to read; the mask's shape is all there is
        return _MaskedScale.apply(x, torch.empty(b, s_local, h, dtype=torch.bool, device=x.device), 1.0 / (1.0 - p))
    masks = []
    for sample in sample_ids.tolist():
        gen = torch.Generator(device=x.device).manual_seed(stable_seed("dropout", seed, step, int(sample), layer, site))
        keep = split_for_cp(torch.rand(s_local * n * cp, h, generator=gen, device=x.device) >= p, cp,
                            pstate.coord("cp") if cp > 1 else 0, seq_dim=0)
        masks.append(keep[start : start + s_local])
    return _MaskedScale.apply(x, torch.stack(masks), 1.0 / (1.0 - p))


class _MaskedScale(torch.autograd.Function):
    """``x * mask * scale`` saving the 1-byte bool mask for backward (what the planner counts), not the mask
    in ``x``'s dtype that autograd would keep for ``x * mask.to(x.dtype)``. The mask is 0 or 1, so both
    products are exact in either order: the values are those of the plain expression."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(mask)
        ctx.scale = scale
        return x * mask.to(x.dtype) * scale

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (mask,) = ctx.saved_tensors
        return grad * mask.to(grad.dtype) * ctx.scale, None, None
