"""One rank of the real job, built without communicating: its bytes and its messages per step.

``dry_run_rank(rj, rank)`` builds, on the fake backend and the meta device (``fake_world``):
the rank's model chunks (the trainer's ``build_chunks``), its ``ZeroOptimizer`` (parameter,
gradient and optimizer-state bytes are the optimizer's own ``MemoryTracker`` counts after
construction, i.e. its real flat buffers and shards, padding included), and its stage's
schedule (``build_schedule``). Activation bytes are the planner's estimate for the stage
(``planning.memory.stage_activation_bytes``, fused-kernel assumptions). Any failure becomes
``RankReport.error``: one line naming the rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from parallel3d.config import ResolvedJob
from parallel3d.dryrun.fake_world import fake_rank_state
from parallel3d.dryrun.messages import Messages, pipeline_messages, tensor_parallel_messages, zero_messages
from parallel3d.pipeline.actions import COMPUTE_KINDS
from parallel3d.pipeline.p2p import MessageSpec
from parallel3d.pipeline.partition import partition_layers, stage_layer_ranges
from parallel3d.pipeline.placement import placement_for
from parallel3d.pipeline.schedules import build_schedule
from parallel3d.planning.activations import ActivationAssumptions
from parallel3d.planning.cli import layout_from_job
from parallel3d.planning.cluster import ClusterSpec
from parallel3d.planning.memory import stage_activation_bytes
from parallel3d.trainer import build_chunks
from parallel3d.zero import ZeroOptimizer
from parallel3d.zero.precision import precision_dtype


@dataclass
class RankReport:
    """What one rank of the real job holds and sends per step (bytes per rank)."""

    rank: int
    coords: dict[str, int] = field(default_factory=dict)
    layers: int = 0  # transformer layers on this rank (all its chunks)
    params: int = 0  # parameter elements of its model chunks (its tp shard, no padding)
    param_bytes: int = 0  # the optimizer's model-weights buffers (stage 3: the own shard)
    grad_bytes: int = 0
    optimizer_state_bytes: int = 0  # fp32 masters + Adam moments on the device
    offloaded_bytes: int = 0  # optimizer state in host memory or on disk
    activation_bytes: int = 0  # planner's estimate at the stage's peak
    actions: dict[str, int] = field(default_factory=dict)  # schedule actions per step by kind
    messages: list[Messages] = field(default_factory=list)
    error: str | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def build_optimizer(rj: ResolvedJob, chunks: list[torch.nn.Module], pstate) -> ZeroOptimizer:
    """The rank's optimizer with the trainer's arguments (``Trainer.__init__``)."""
    t, o = rj.job.train, rj.optimizer
    return ZeroOptimizer(
        chunks, pstate, **dataclasses.asdict(rj.zero), lr=o.lr, betas=o.betas, eps=o.eps,
        weight_decay=o.weight_decay, clip_grad=o.clip_grad or None, precision=t.precision,
        fused_adamw_backend="torch" if rj.model.kernel_backend == "torch" else "auto",
    )


def _root_buckets(optimizer: ZeroOptimizer) -> frozenset[tuple[int, int]]:
    """(layout, bucket) of stage 3's root units, in the optimizer's layout indices (mixed stages too)."""
    params = optimizer.params
    parts = getattr(params, "parts", [params])
    return frozenset(params.global_key(part, b) if part is not params else b
                     for part in parts for u in getattr(part, "units", []) if u.is_root for b in u.buckets)


def _stage_layers(rj: ResolvedJob, stage: int) -> int:
    p = rj.job.parallel
    ranges = partition_layers(rj.model, p.pp, p.virtual_stages, p.pp_layers, seq_len=rj.train.seq_len)
    place = placement_for(p.schedule, p.pp, p.virtual_stages)
    return sum(b - a for a, b in stage_layer_ranges(ranges, p.pp, stage, place))


def _activation_bytes(rj: ResolvedJob, stage: int, layers: int) -> int:
    _, layout, _ = layout_from_job(rj.job, ClusterSpec.build(rj.world_size, 1))
    assumptions = ActivationAssumptions.for_model(rj.model, layout.precision)
    return int(stage_activation_bytes(rj.model, layout, stage, layers, assumptions)[0])


def _fill(report: RankReport, rj: ResolvedJob) -> None:
    p, t = rj.job.parallel, rj.train
    with fake_rank_state(rj.topology, report.rank) as pstate:
        report.coords = {d: pstate.coord(d) for d in ("tp", "cp", "dp", "pp") if pstate.size(d) > 1}
        stage = pstate.coord("pp")
        chunks = build_chunks(rj, pstate)
        report.params = sum(q.numel() for c in chunks for q in c.parameters())
        optimizer = build_optimizer(rj, chunks, pstate)
        held = optimizer.memory.current
        report.param_bytes, report.grad_bytes = held["model_weights"], held["gradients"]
        report.optimizer_state_bytes = held["master_weights"] + held["optimizer_moments"]
        report.offloaded_bytes = held["offload_host"] + held["offload_disk"]
        grad_itemsize = precision_dtype(rj.zero.grad_reduce_dtype).itemsize
        report.messages += zero_messages(
            optimizer.layouts, zero_stage=[optimizer.layout_stage(g) for g in range(len(optimizer.layouts))],
            microbatches=rj.grad_accum,
            grad_itemsize=grad_itemsize, zero3_mode=rj.zero.zero3_mode(p.pp),
            embedding_group=len(pstate.ranks("embedding")) > 1,
            root_buckets=_root_buckets(optimizer))
    report.layers = _stage_layers(rj, stage)
    # The real job runs on NCCL: p2p batches complete as one unit (schedules' coalesced_p2p).
    schedule = build_schedule(p.schedule, p.pp, rj.grad_accum, p.virtual_stages, coalesced_p2p=True)
    actions = schedule[stage]
    report.actions = {k: sum(a.kind == k for a in actions) for k in COMPUTE_KINDS if any(a.kind == k for a in actions)}
    dtype = precision_dtype(t.precision)
    spec = MessageSpec.from_config(micro_batch_size=t.micro_batch_size, seq_len=t.seq_len,
                                   hidden_size=rj.model.hidden_size, dtype=dtype, tp_size=p.tp,
                                   sequence_parallel=p.sequence_parallel)
    message_bytes = spec.dtype.itemsize * int(torch.Size(spec.shape).numel())
    report.messages = pipeline_messages(actions, message_bytes) + report.messages
    full_activation = t.micro_batch_size * t.seq_len * rj.model.hidden_size * dtype.itemsize
    report.messages += tensor_parallel_messages(p.tp, report.layers, rj.grad_accum, full_activation,
                                                sequence_parallel=p.sequence_parallel,
                                                full_recompute=t.recompute == "full")
    report.activation_bytes = _activation_bytes(rj, stage, report.layers)


def dry_run_rank(rj: ResolvedJob, rank: int) -> RankReport:
    """``rank``'s report; a failure anywhere is caught into ``error`` (one line naming the rank)."""
    report = RankReport(rank=rank)
    try:
        _fill(report, rj)
    except Exception as exc:  # noqa: BLE001 - the dry run reports every rank's failure, one line each
        cause = (str(exc).strip().splitlines() or [""])[0]
        report.error = f"rank {rank}: {type(exc).__name__}: {cause}"
    return report
