"""Moving between a parameter's full (unsharded, unpadded) value and this rank's shard of it.

A parameter's shard is chunk ``coord(kind)`` of its full value along ``dim``, where
``(kind, dim) = param_meta.shard_grid(param)``: the ``tp`` group and ``tp_split_dim`` for dense
parameters, the expert tensor-parallel group ``etp`` and ``etp_split_dim`` for routed experts
(their own grid: etp may differ from tp). Dim 0 is first padded with zero rows up to the padded
vocabulary when the parameter carries ``unpadded_rows``. Parameters whose ``dim`` is None are
their full value. Which expert an ep rank holds is not a shard: a routed expert's "full value"
here is that one expert's whole matrix (``models.state`` gathers the experts over ep). Used by
HF import/export, tests and checkpoint conversion.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from parallel3d.param_meta import shard_grid
from parallel3d.tensor_parallel.mappings import all_gather_along_dim

if TYPE_CHECKING:  # pragma: no cover
    from parallel3d.parallel_state import ParallelState


def full_shape(param: torch.Tensor, pstate: "ParallelState") -> tuple[int, ...]:
    """The unpadded shape of the whole parameter across its grid's group."""
    shape = list(param.shape)
    kind, dim = shard_grid(param)
    if dim is not None:
        shape[dim] *= pstate.size(kind)
    rows = getattr(param, "unpadded_rows", None)
    if rows is not None:
        shape[0] = rows
    return tuple(shape)


def shard_of(full: torch.Tensor, param: torch.Tensor, pstate: "ParallelState") -> torch.Tensor:
    """This rank's shard of ``full`` for ``param`` (shape checked by the caller)."""
    rows = getattr(param, "unpadded_rows", None)
    kind, dim = shard_grid(param)
    if rows is not None and dim is not None:
        padded = param.shape[0] * pstate.size(kind) if dim == 0 else param.shape[0]
        if padded > full.shape[0]:
            pad = full.new_zeros((padded - full.shape[0], *full.shape[1:]))
            full = torch.cat([full, pad], dim=0)
    if dim is None:
        return full
    return full.chunk(pstate.size(kind), dim=dim)[pstate.coord(kind)]


def gather_full(param: torch.Tensor, pstate: "ParallelState", value: torch.Tensor | None = None) -> torch.Tensor:
    """The whole parameter (all-gathered over its grid's group, padding rows dropped); a detached copy.

    ``value``: a tensor sharded like ``param`` to gather instead (e.g. ``param.grad``).
    """
    kind, dim = shard_grid(param)
    value = (param if value is None else value).detach()
    if dim is not None:
        value = all_gather_along_dim(value, dim, pstate, kind)
    rows = getattr(param, "unpadded_rows", None)
    if rows is not None:
        value = value[:rows]
    return value.clone()
