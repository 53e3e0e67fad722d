"""Metadata that parameters carry for ZeRO, clipping and checkpointing.

Attributes set on ``torch.nn.Parameter`` objects (by the layers that create them):

- ``tp_split_dim`` (int | None): the dimension split over the TP group, or
  ``None`` for a parameter replicated across TP (norm weights, row-parallel
  biases). Gradient-norm clipping sums squares of split parameters over TP and
  counts replicated ones once.
- ``global_name`` (str): the layout-independent name (e.g.
  ``layers.3.attn.qkv.weight``) used for init seeding and checkpoints.
- ``tied_embedding`` (bool): a copy of the tied input/output embedding held by a
  model chunk with only one of the two ends (pp > 1); the two copies' gradients are
  summed (over the ``embedding`` group, or on one rank where a schedule places both
  ends there, ZB-V) and the pair is counted once in the grad norm and checkpoints.
- ``tied_head_copy`` (bool): the copy read by the output head (the chunk without the
  embedding); the grad norm and checkpoints skip it, the embedding's copy stands for both.
- ``expert_index`` (int): a routed expert's global index (``parallel3d.moe.experts``); the
  parameter is replicated over ``edp`` only, each rank of ``etp x ep`` holds a different piece.
- ``etp_split_dim`` (int | None): for a routed expert, the dimension split over the expert
  tensor-parallel group ``etp`` (its own grid: ``etp`` may differ from ``tp``); ``tp_split_dim``
  is not set on experts.

``shard_grid`` is the one reading of these: which group kind a parameter's shards are laid
out over (``tp`` or ``etp``) and along which dimension. Checkpoints (``checkpoint_io``) map
every parameter to its global tensor through it.
- ``no_weight_decay`` (bool): norms and biases are excluded from weight decay.
- ``wgrad_deferrable`` (bool): the parameter is read only by layers that can defer its
  gradient (``parallel3d.deferred_grads``), so a zero-bubble ``B`` may leave it to ``W``.
  Set only where that holds: a deferring layer's output feeding anything else is fine,
  but a second reader of the parameter itself would lose its gradient in ``B``.
"""

from __future__ import annotations

import torch


def set_meta(
    param: torch.nn.Parameter,
    *,
    tp_split_dim: int | None = None,
    global_name: str | None = None,
    tied_embedding: bool | None = None,
    tied_head_copy: bool | None = None,
    no_weight_decay: bool | None = None,
    wgrad_deferrable: bool | None = None,
) -> torch.nn.Parameter:
    if tp_split_dim is not None:
        param.tp_split_dim = tp_split_dim
    if global_name is not None:
        param.global_name = global_name
    if tied_embedding is not None:
        param.tied_embedding = tied_embedding
    if tied_head_copy is not None:
        param.tied_head_copy = tied_head_copy
    if no_weight_decay is not None:
        param.no_weight_decay = no_weight_decay
    if wgrad_deferrable is not None:
        param.wgrad_deferrable = wgrad_deferrable
    return param


def tp_split_dim(param: torch.Tensor) -> int | None:
    return getattr(param, "tp_split_dim", None)


def is_tp_split(param: torch.Tensor) -> bool:
    return tp_split_dim(param) is not None


def is_tied_embedding(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tied_embedding", False))


def is_tied_head_copy(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tied_head_copy", False))


def is_wgrad_deferrable(param: torch.Tensor) -> bool:
    return bool(getattr(param, "wgrad_deferrable", False))


def no_weight_decay(param: torch.Tensor) -> bool:
    """Norm weights and biases (1-D tensors) are not decayed unless marked otherwise."""
    flag = getattr(param, "no_weight_decay", None)
    return param.ndim < 2 if flag is None else bool(flag)


def is_expert_param(param: torch.Tensor) -> bool:
    """A routed expert's parameter (replicas: the ``edp`` group; see ``expert_index``)."""
    return getattr(param, "expert_index", None) is not None


def shard_grid(param: torch.Tensor) -> tuple[str, int | None]:
    """``(kind, dim)``: the group kind whose ranks hold different chunks of ``param`` along ``dim``
    (chunk ``coord(kind)``), or whose every rank holds all of it (``dim`` None).

    Routed experts use the expert grid (``etp``, ``etp_split_dim``), everything else ``tp``."""
    if is_expert_param(param):
        return "etp", getattr(param, "etp_split_dim", None)
    return "tp", tp_split_dim(param)
