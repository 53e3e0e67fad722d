"""Which buffers and strategies serve a ``ZeroOptimizer``: its layouts (one per replica group kind)
and, per ZeRO stage in use, the parameter and gradient-synchronisation strategy over them.

Invariant: every trainable parameter of the modules lies in exactly one ``BufferLayout``;
dense parameters are replicated over ``dp_cp`` (``DENSE_REDUCE_KIND``: data and context
parallel ranks hold the same weights), routed experts over ``edp`` (``EXPERT_REDUCE_KIND``),
each kind at its own stage (``stage_of_kind``). A layout's stage picks its strategies:
``ReplicatedParams`` for stages 0-2 and ``ShardedParams`` for 3; ``ReplicatedGradSync`` for
stages 0/1 and ``ShardedGradSync`` for 2/3. Layouts of different stages are presented as one
(``mixed``) under the global layout indices, in layout order on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parallel3d import comm
from parallel3d.param_meta import is_expert_param
from parallel3d.parallel_state import ParallelState
from parallel3d.zero import clip
from parallel3d.zero.buffers import BufferLayout
from parallel3d.zero.grad_replicated import ReplicatedGradSync
from parallel3d.zero.grad_sharded import ShardedGradSync
from parallel3d.zero.grad_sync import GradSync
from parallel3d.zero.memory import MemoryTracker
from parallel3d.zero.mixed import MixedGradSync, MixedParams
from parallel3d.zero.options import resolve_reshard
from parallel3d.zero.params_replicated import ReplicatedParams
from parallel3d.zero.params_sharded import ShardedParams
from parallel3d.zero.units import find_units, unit_index_of

DENSE_REDUCE_KIND = "dp_cp"  # the group holding the replicas of a dense parameter
EXPERT_REDUCE_KIND = "edp"  # the group holding the replicas of a routed expert's parameter
FIRST_BUCKET_BYTES = 2**20  # DDP's first bucket: the first reduction starts after ~1 MiB of gradients
__all__ = ["DENSE_REDUCE_KIND", "EXPERT_REDUCE_KIND", "FIRST_BUCKET_BYTES", "Strategies", "bucket_numels",
           "build_layouts", "build_strategies", "make_grad_sync", "named_params"]


def bucket_numels(bucket_size_mb: float, itemsize: int) -> tuple[int, int]:
    """(first bucket's, every other bucket's) element limit of ``bucket_size_mb`` buckets of ``itemsize``-byte
    elements: the first holds DDP's ~1 MiB (never more than a bucket), so the first reduction starts early."""
    bucket = max(1, int(bucket_size_mb * 2**20) // itemsize)
    return min(bucket, FIRST_BUCKET_BYTES // itemsize), bucket


def named_params(modules: list[torch.nn.Module]) -> list[tuple[str, torch.nn.Parameter]]:
    """Every trainable parameter once, in registration order, under its global name (or its
    module-local name, prefixed by the chunk index when there are several chunks)."""
    out, seen = [], set()
    for i, m in enumerate(modules):
        for name, p in m.named_parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            out.append((getattr(p, "global_name", None) or (name if len(modules) == 1 else f"{i}.{name}"), p))
    return out


def make_grad_sync(modules: list[torch.nn.Module], layouts: list[BufferLayout], pstate: ParallelState, *,
                   zero_stage: int, device: torch.device, grad_dtype: torch.dtype, reduce_scatter: str,
                   memory: MemoryTracker) -> GradSync:
    """The gradient-synchronisation strategy of ``zero_stage``."""
    common = dict(device=device, grad_dtype=grad_dtype, reduce_scatter=reduce_scatter, memory=memory)
    if zero_stage in (0, 1):
        return ReplicatedGradSync(modules, layouts, pstate, zero_stage=zero_stage, **common)
    if zero_stage in (2, 3):
        return ShardedGradSync(modules, layouts, pstate, **common)
    raise ValueError(f"no gradient synchronisation for ZeRO stage {zero_stage}")


def build_layouts(named: list[tuple[str, torch.nn.Parameter]], pstate: ParallelState,
                  stage_of_kind: dict[str, int], units: list | None, *, dtype: torch.dtype,
                  bucket_size_mb: float) -> list[BufferLayout]:
    """One layout per replica group kind that has parameters (dense first, then routed experts).

    Buckets hold ``bucket_size_mb`` of parameter-dtype bytes (the first one DDP's 1 MiB); at
    stage 3 a bucket never spans two gather units, so a unit is whole buckets."""
    first_bucket_numel, bucket_numel = bucket_numels(bucket_size_mb, dtype.itemsize)
    unit_of = None
    if units is not None:  # ``find_units`` of the modules, given when a stage is 3
        index = unit_index_of(units)
        unit_of = lambda p: index[id(p)]  # noqa: E731 - a bucket never spans two gather units
    layouts = []
    for kind, params in ((DENSE_REDUCE_KIND, [(n, p) for n, p in named if not is_expert_param(p)]),
                         (EXPERT_REDUCE_KIND, [(n, p) for n, p in named if is_expert_param(p)])):
        if not params:
            continue
        replicas = comm.group_size(pstate, kind)
        sharded = stage_of_kind[kind] > 0
        layouts.append(BufferLayout(
            params, bucket_numel=bucket_numel, reduce_kind=kind, replicas=replicas,
            owner_count=replicas if sharded else 1,
            owner_index=comm.group_rank(pstate, kind) if sharded else 0,
            count_in_norm=lambda p: clip.counts_in_norm(p, pstate),
            unit_of=unit_of if stage_of_kind[kind] == 3 else None, first_bucket_numel=first_bucket_numel,
        ))
    return layouts


@dataclass
class Strategies:
    """The parameter holder and gradient synchroniser of every layout (one object each, mixed or not)."""

    params: ReplicatedParams | ShardedParams | MixedParams
    grad_sync: GradSync | MixedGradSync


def build_strategies(modules: list[torch.nn.Module], layouts: list[BufferLayout], pstate: ParallelState,
                     stage_of_kind: dict[str, int], units: list | None, *, device: torch.device, grad_dtype: torch.dtype,
                     reduce_scatter: str, memory: MemoryTracker, zero3_prefetch: int, zero3_reshard: str,
                     overlap_param_gather: bool) -> Strategies:
    """One params / grad-sync strategy per stage in use (in layout order), presented as one."""
    stages: list[int] = []
    for layout in layouts:
        if stage_of_kind[layout.reduce_kind] not in stages:
            stages.append(stage_of_kind[layout.reduce_kind])
    groups = [[g for g, layout in enumerate(layouts) if stage_of_kind[layout.reduce_kind] == st] for st in stages]
    param_parts, sync_parts = [], []
    for st, members in zip(stages, groups):
        part_layouts = [layouts[g] for g in members]
        if st == 3:
            params_part: ReplicatedParams | ShardedParams = ShardedParams(
                part_layouts, units, pstate, device=device, memory=memory, prefetch=zero3_prefetch,
                reshard=resolve_reshard(zero3_reshard, pstate.size("pp")))
        else:
            overlap_units = find_units(modules) if overlap_param_gather and st > 0 else None
            params_part = ReplicatedParams(part_layouts, pstate, device=device, sharded=st > 0,
                                           memory=memory, overlap_units=overlap_units)
        param_parts.append(params_part)
        sync_parts.append(make_grad_sync(modules, part_layouts, pstate, zero_stage=st, device=device,
                                         grad_dtype=grad_dtype, reduce_scatter=reduce_scatter, memory=memory))
    for members, sync in zip(groups, sync_parts):  # tied embeddings are dense: one part sums them
        sync.sums_tied = any(layouts[g].reduce_kind == DENSE_REDUCE_KIND for g in members)
    if len(stages) == 1:
        out = Strategies(params=param_parts[0], grad_sync=sync_parts[0])
    else:
        out = Strategies(params=MixedParams(param_parts, groups, layouts), grad_sync=MixedGradSync(sync_parts, groups))
    sharded_parts = [p for p in param_parts if isinstance(p, ShardedParams)]
    if sharded_parts:  # it counts a unit's gradients whichever stage reduces them
        out.grad_sync.add_observer(sharded_parts[0])
    return out
