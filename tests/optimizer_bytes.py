"""Bytes a rank's ``ZeroOptimizer`` holds, counted from its own tensors (not from its memory tracker).

``held_state_bytes(opt)``: weights (stage 0-2 weight buffers, or stage 3 shards), gradients (buffers, or
shards at stage 2-3), fp32 master weights and Adam moments on the device, each summed over storages as
``numel * element_size``, and ``offloaded``: with ``parallel.offload=cpu`` the masters and moments live in
host memory with the host's two gradient and (half precision) two parameter staging buffers, counted
there and not as device state; an optimizer with experts at another ZeRO stage (``zero.mixed``) is
counted over its parts. Tests compare these with what the code under test reports (the dry run, the logged keys).
"""

from __future__ import annotations

from typing import Iterable

import torch


def nbytes(tensors: Iterable[torch.Tensor | None]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def held_state_bytes(opt) -> dict[str, int]:
    """{"weights", "gradients", "masters", "moments", "offloaded"}: bytes this rank holds now."""
    parts = getattr(opt.params, "parts", [opt.params])
    weights = [w for part in parts for w in ([b.data for b in part.bufs] if hasattr(part, "bufs") else part.shards)]
    syncs = getattr(opt.grad_sync, "parts", [opt.grad_sync])
    grads = [g for sync in syncs
             for g in ([b.data for b in sync.grad_bufs] if hasattr(sync, "grad_bufs") else sync.grad_shards)]
    masters, moments = nbytes(opt.masters), nbytes(list(opt.exp_avgs) + list(opt.exp_avg_sqs))
    if getattr(opt.states, "offload", None) != "cpu":  # (disk: the files and their buffers are not counted)
        return {"weights": nbytes(weights), "gradients": nbytes(grads), "masters": masters, "moments": moments,
                "offloaded": 0}
    host = masters + moments + nbytes([*opt.states.grad_bufs, *opt.states.param_stage])
    return {"weights": nbytes(weights), "gradients": nbytes(grads), "masters": 0, "moments": 0, "offloaded": host}
