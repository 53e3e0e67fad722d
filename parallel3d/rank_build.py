"""This rank's pieces of a ``ResolvedJob`` that the trainer, the dry run and tests share: its process groups
(``make_parallel_state``) and its pipeline stage's model chunks (``build_chunks``).

Invariant: every rank calls both, in this order, once per job (``ContextParallelAttention.build`` inside
``build_chunks`` may create cp sub-groups, a collective over the world); the chunks a rank gets are the ones
its schedule's placement assigns to its pp coordinate, built from the same seed on every layout.
"""

from __future__ import annotations

import os

import torch

from models import build_model
from parallel3d.config import ResolvedJob
from parallel3d.context_parallel.model_attention import ContextParallelAttention
from parallel3d.parallel_state import ParallelState, init_distributed
from parallel3d.pipeline.partition import partition_layers, stage_layer_ranges
from parallel3d.pipeline.placement import placement_for
from parallel3d.zero.precision import precision_dtype

__all__ = ["build_chunks", "make_parallel_state"]


def make_parallel_state(rj: ResolvedJob) -> ParallelState:
    """Initialise torch.distributed (if launched by torchrun) and build this rank's groups."""
    backend = "nccl" if rj.device == "cuda" else "gloo"
    init_distributed(backend, rj.job.train.timeout_s)
    device = None
    if rj.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    return ParallelState(rj.topology, backend=backend, timeout_s=rj.job.train.timeout_s, device=device)


def build_chunks(rj: ResolvedJob, pstate: ParallelState) -> list[torch.nn.Module]:
    """This stage's model chunks, by local chunk: model chunk ``placement.model_chunk(pp_rank, c)`` for
    c < virtual_stages, where the schedule places them (``pipeline.placement``: ``pp_rank + c * pp``
    in a loop; ZB-V's V: ``pp_rank`` and ``2 pp - 1 - pp_rank``)."""
    p, t = rj.job.parallel, rj.job.train
    ranges = partition_layers(rj.model, p.pp, p.virtual_stages, p.pp_layers, seq_len=t.seq_len)
    last = len(ranges) - 1
    chunks = []
    # One for all chunks: with a2a+p2p it creates the cp sub-groups (collective, every rank once).
    cp_attention = ContextParallelAttention.build(pstate, rj.context_parallel, t.timeout_s)
    place = placement_for(p.schedule, p.pp, p.virtual_stages)
    for k, layer_range in zip(place.chunks_of(pstate.coord("pp")), stage_layer_ranges(ranges, p.pp, pstate.coord("pp"), place)):
        chunks.append(build_model(
            rj.model, pstate, seed=t.seed, layer_range=layer_range, pre_process=k == 0, post_process=k == last,
            sequence_parallel=p.sequence_parallel, recompute=t.recompute, dtype=precision_dtype(t.precision),
            device=pstate.device, context_parallel=cp_attention,
        ))
    return chunks
