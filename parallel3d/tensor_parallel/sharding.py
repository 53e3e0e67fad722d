"""Moving between a parameter's full (unsharded, unpadded) value and this rank's tp shard.

A parameter's shard is chunk ``tp_rank`` of its full value along ``tp_split_dim``
(``parallel3d.param_meta``), after padding dim 0 with zero rows up to the padded
vocabulary when the parameter carries ``unpadded_rows``. Replicated parameters
(``tp_split_dim is None``) are their full value. Used by HF import/export, tests and
checkpoint conversion.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from parallel3d import comm
from parallel3d.param_meta import tp_split_dim
from parallel3d.tensor_parallel.mappings import all_gather_along_dim

if TYPE_CHECKING:  # pragma: no cover
    from parallel3d.parallel_state import ParallelState


def full_shape(param: torch.Tensor, pstate: "ParallelState") -> tuple[int, ...]:
    """The unpadded shape of the whole parameter across the tp group."""
    shape = list(param.shape)
    dim = tp_split_dim(param)
    if dim is not None:
        shape[dim] *= pstate.size("tp")
    rows = getattr(param, "unpadded_rows", None)
    if rows is not None:
        shape[0] = rows
    return tuple(shape)


def shard_of(full: torch.Tensor, param: torch.Tensor, pstate: "ParallelState") -> torch.Tensor:
    """This rank's shard of ``full`` for ``param`` (shape checked by the caller)."""
    rows = getattr(param, "unpadded_rows", None)
    dim = tp_split_dim(param)
    if rows is not None and dim is not None:
        padded = param.shape[0] * pstate.size("tp") if dim == 0 else param.shape[0]
        if padded > full.shape[0]:
            pad = full.new_zeros((padded - full.shape[0], *full.shape[1:]))
            full = torch.cat([full, pad], dim=0)
    if dim is None:
        return full
    return full.chunk(pstate.size("tp"), dim=dim)[pstate.coord("tp")]


def gather_full(param: torch.Tensor, pstate: "ParallelState", value: torch.Tensor | None = None) -> torch.Tensor:
    """The whole parameter (all-gathered over tp, padding rows dropped); a detached copy.

    ``value``: a tensor sharded like ``param`` to gather instead (e.g. ``param.grad``).
    """
    dim = tp_split_dim(param)
    value = (param if value is None else value).detach()
    if dim is not None and comm.group_size(pstate, "tp") > 1:
        value = all_gather_along_dim(value, dim, pstate)
    rows = getattr(param, "unpadded_rows", None)
    if rows is not None:
        value = value[:rows]
    return value.clone()
