"""Micro-benchmark: how long an MoE layer spends moving tokens vs computing experts.

``bench_dispatch_vs_experts(layer, x, steps=...)`` runs the layer's phases separately on
every rank of its groups (all ranks must call it together, with the same ``steps``):
routing (router + capacity + losses), dispatch (count exchange, host sync, permutation,
all-to-all / all-gather, expert-TP gather), expert compute (the grouped GEMMs and SwiGLU),
combine (the reverse exchange and weighted sum) and a whole forward + backward. Each phase
is bracketed by a device synchronisation, so a phase's time includes waiting for the
slowest peer of its collectives (that wait is part of what dispatch costs). Returns
medians in seconds plus the token and expert-row counts; ``scripts/bench_moe.py``
tabulates them at ep 1 / 2 / 4.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from parallel3d.moe.capacity import capacity_keep_mask
from parallel3d.moe.layer import MoELayer


def _sync_for(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def bench_dispatch_vs_experts(layer: MoELayer, x: torch.Tensor, *, steps: int = 5, warmup: int = 1,
                              token_ids: torch.Tensor | None = None) -> dict[str, float]:
    """Median seconds per phase for ``x [b, s, h]`` through ``layer`` (see the module docstring)."""
    sync = _sync_for(x.device)
    o = layer.options
    b, s, h = x.shape
    tokens = x.reshape(b * s, h)
    phases: dict[str, list[float]] = {"route": [], "dispatch": [], "experts": [], "combine": [], "forward_backward": []}
    rows = 0
    for step in range(warmup + steps):
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            routing = layer.router(tokens)
            keep = capacity = None
            if o.capacity_factor is not None:
                keep, capacity = capacity_keep_mask(
                    routing.indices, routing.selected_scores, layer.token_ids_for(b, s, token_ids, x.device),
                    num_experts=o.num_experts, capacity_factor=o.capacity_factor, policy=o.drop_policy,
                    token_group=layer.token_group)
            sync()
            t1 = time.perf_counter()
            dispatched = layer.dispatcher.dispatch(tokens, routing.indices, keep, capacity)
            sync()
            t2 = time.perf_counter()
            expert_out = layer.experts(dispatched.rows, dispatched.sizes)
            sync()
            t3 = time.perf_counter()
            weights = routing.weights if keep is None else routing.weights * keep
            layer.dispatcher.combine(expert_out, dispatched, weights)
            sync()
            t4 = time.perf_counter()
        inp = x.detach().requires_grad_(True)
        layer(inp, token_ids).float().square().mean().backward()
        sync()
        t5 = time.perf_counter()
        layer.zero_grad(set_to_none=True)
        layer.stats.reset()
        if step >= warmup:
            for name, seconds in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                phases[name].append(seconds)
            rows = dispatched.rows.shape[0]
    out = {f"{name}_s": statistics.median(values) for name, values in phases.items()}
    out.update(tokens=float(b * s), expert_rows=float(rows), dispatch_over_experts=(
        (out["dispatch_s"] + out["combine_s"]) / out["experts_s"] if out["experts_s"] > 0 else float("inf")))
    return out
