"""Full (layout-independent) state dicts of a possibly tp-sharded model.

Keys are the parameters' ``global_name`` (equal to their module path, e.g.
``layers.3.attn.qkv.weight``); values are full, unpadded tensors. Gathering is a
collective over the model's tp group (all tp ranks must call it); loading only slices.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from parallel3d.tensor_parallel.sharding import full_shape, gather_full, shard_of


def _named(model: nn.Module) -> dict[str, nn.Parameter]:
    return {getattr(p, "global_name", name): p for name, p in model.named_parameters()}


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{global_name: full tensor}`` of every parameter of ``model`` (collective over tp)."""
    pstate = model.pstate
    return {name: gather_full(p, pstate) for name, p in _named(model).items()}


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{global_name: full gradient}`` for parameters that have one (collective over tp)."""
    pstate = model.pstate
    return {name: gather_full(p, pstate, p.grad) for name, p in _named(model).items() if p.grad is not None}


def check_keys(expected: set[str], given: set[str], what: str) -> None:
    """Raise a ValueError listing the missing and unexpected keys by name."""
    missing, extra = sorted(expected - given), sorted(given - expected)
    if missing or extra:
        raise ValueError(f"{what}: missing keys {missing}; unexpected keys {extra}")


def load_full_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor], *, strict: bool = True) -> None:
    """Copy this rank's shard of every full tensor in ``state`` into ``model`` (no communication).

    Raises ValueError for missing/unexpected keys (``strict``) or a wrong shape, naming the
    key and both shapes, before any parameter is modified.
    """
    pstate = model.pstate
    params = _named(model)
    if strict:
        check_keys(set(params), set(state), "state dict does not match the model")
    plan = []
    for name, p in params.items():
        if name not in state:
            continue
        want = full_shape(p, pstate)
        got = tuple(state[name].shape)
        if got != want:
            raise ValueError(f"{name}: shape {got} in the state dict, but the model expects {want}")
        plan.append((p, state[name]))
    with torch.no_grad():
        for p, full in plan:
            p.copy_(shard_of(full.to(device=p.device, dtype=p.dtype), p, pstate))
