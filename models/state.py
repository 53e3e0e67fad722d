"""Full (layout-independent) state dicts of a possibly sharded model.

Keys are the parameters' ``global_name`` (equal to their module path, e.g.
``layers.3.attn.qkv.weight``); values are full, unpadded tensors. Routed experts are keyed by
their GLOBAL expert index (``layers.<i>.mlp.experts.<e>.w1``), as in checkpoints, whatever ep
rank holds them: a full state dict holds every expert of the model's layers.

The grid (``parallel3d.param_meta.shard_grid``): dense parameters are split over ``tp``, a
routed expert's matrix over ``etp`` (``tensor_parallel.sharding``), and the experts themselves
over ``ep`` in consecutive blocks (``parallel3d.moe.expert_layout``: ep rank ``r`` holds
``[r * L, (r + 1) * L)`` of a layer's experts, ``L`` per rank). Gathering is a collective over
the tp, etp and ep groups (all ranks of them must call it, with the same parameters); loading
only slices (no communication).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Mapping

import torch
from torch import nn

from parallel3d import comm
from parallel3d.param_meta import is_expert_param
from parallel3d.tensor_parallel.mappings import all_gather_along_dim
from parallel3d.tensor_parallel.sharding import full_shape, gather_full, shard_of

if TYPE_CHECKING:  # pragma: no cover
    from parallel3d.parallel_state import ParallelState


def _named(model: nn.Module) -> dict[str, nn.Parameter]:
    return {getattr(p, "global_name", name): p for name, p in model.named_parameters()}


def _expert_renamer(params: Mapping[str, nn.Parameter], pstate: "ParallelState") -> Callable[[str, int], str]:
    """``rename(name, r)``: the global name of the expert parameter that ep rank ``r`` holds in the
    slot where this rank holds ``name`` (same layer, same matrix, index shifted by whole blocks)."""
    per_layer: dict[str, set[int]] = {}
    for name, p in params.items():
        if is_expert_param(p):
            per_layer.setdefault(name.rpartition(".experts.")[0], set()).add(p.expert_index)
    mine = pstate.coord("ep")

    def rename(name: str, rank: int) -> str:
        layer, _, rest = name.rpartition(".experts.")
        index, _, matrix = rest.partition(".")
        shifted = int(index) + (rank - mine) * len(per_layer[layer])
        return f"{layer}.experts.{shifted}.{matrix}"

    return rename


def _full_values(model: nn.Module, value_of: Callable[[nn.Parameter], torch.Tensor | None]) -> dict[str, torch.Tensor]:
    """``{global_name: full value_of(p)}``; experts of every ep rank included (see module doc)."""
    pstate = model.pstate
    params = _named(model)
    out = {name: gather_full(p, pstate, value_of(p)) for name, p in params.items()
           if not is_expert_param(p) and value_of(p) is not None}
    experts = [(name, p) for name, p in params.items() if is_expert_param(p)]
    ep = comm.group_size(pstate, "ep")
    if ep == 1 or not experts:
        out.update({name: gather_full(p, pstate, value_of(p)) for name, p in experts if value_of(p) is not None})
        return out
    # Every ep rank holds the same slots (same layers, as many experts each): gather slot by slot. A
    # value may be missing on some ranks only (a gradient), so presence travels with the values.
    rename = _expert_renamer(params, pstate)
    present = torch.tensor([value_of(p) is not None for _, p in experts], dtype=torch.float32,
                           device=experts[0][1].device)
    present = all_gather_along_dim(present, 0, pstate, "ep").view(ep, -1)
    for slot, (name, p) in enumerate(experts):
        value = value_of(p)
        full = gather_full(p, pstate, torch.zeros_like(p) if value is None else value)
        every = all_gather_along_dim(full.unsqueeze(0), 0, pstate, "ep")
        for rank in range(ep):
            if present[rank, slot]:
                out[rename(name, rank)] = every[rank].clone()
    return out


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{global_name: full tensor}`` of every parameter of ``model`` (collective over tp, etp, ep)."""
    return _full_values(model, lambda p: p)


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{global_name: full gradient}`` for parameters that have one (collective over tp, etp, ep)."""
    return _full_values(model, lambda p: p.grad)


def check_keys(expected: set[str], given: set[str], what: str) -> None:
    """Raise a ValueError listing the missing and unexpected keys by name."""
    missing, extra = sorted(expected - given), sorted(given - expected)
    if missing or extra:
        raise ValueError(f"{what}: missing keys {missing}; unexpected keys {extra}")


def load_full_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor], *, strict: bool = True) -> None:
    """Copy this rank's shard of every full tensor in ``state`` into ``model`` (no communication).

    ``state`` holds every expert (by global index); the other ep ranks' experts are expected and
    skipped. Raises ValueError for missing/unexpected keys (``strict``) or a wrong shape, naming
    the key and both shapes, before any parameter is modified.
    """
    pstate = model.pstate
    params = _named(model)
    if strict:
        rename = _expert_renamer(params, pstate)
        elsewhere = {rename(name, r) for name, p in params.items() if is_expert_param(p)
                     for r in range(pstate.size("ep"))}
        check_keys(set(params) | elsewhere, set(state), "state dict does not match the model")
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
