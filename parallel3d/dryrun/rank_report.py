"""One rank of the real job, built without communicating: its bytes and its messages per step.

``dry_run_rank(rj, rank)`` builds, on the fake backend and the meta device (``fake_world``):
the rank's model chunks (the trainer's ``build_chunks``), its ``ZeroOptimizer`` (parameter,
gradient and optimizer-state bytes are the optimizer's own ``MemoryTracker`` counts after
construction, i.e. its real flat buffers and shards, padding included), and its stage's
schedule (``build_schedule``); then it runs one training step of that schedule on meta tensors
(``step``: the engine, the optimizer step and the parameter sync, as the trainer's step 1).
Activation bytes and messages per step are measured from that step; the planner's activation
estimate (``planning.memory.stage_activation_bytes``) is reported beside the measured peak.
Any failure, in the build or the step, becomes ``RankReport.error``: one line naming the rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from parallel3d.config import ResolvedJob
from parallel3d.dryrun.fake_world import fake_rank_state, runs_on_nccl
from parallel3d.dryrun.messages import Messages
from parallel3d.dryrun.options import check_dry_runnable
from parallel3d.dryrun.meta_kernels import job_runs_fused_kernels
from parallel3d.dryrun.step import Counts, NotLinear, batch_on_host, extrapolate, reduced_microbatches, run_step
from parallel3d.pipeline.actions import COMPUTE_KINDS, splits_backward
from parallel3d.pipeline.partition import partition_layers, stage_layer_ranges
from parallel3d.pipeline.placement import placement_for
from parallel3d.pipeline.schedules import build_schedule
from parallel3d.planning.activations import ActivationAssumptions
from parallel3d.planning.cli import job_w_lags, layout_from_job
from parallel3d.planning.cluster import ClusterSpec
from parallel3d.planning.memory import stage_activation_bytes
from parallel3d.rank_build import build_chunks
from parallel3d.zero import ZeroOptimizer


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
    activation_bytes: int = 0  # measured: the step's peak of saved activations (meta storages)
    activation_bytes_planner: int | None = 0  # the planner's estimate at the stage's peak (None: it has none)
    step_microbatches: list[int] = field(default_factory=list)  # microbatch counts of the steps run
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


def _chunk_ranges(rj: ResolvedJob, stage: int) -> list[tuple[int, int]]:
    """The layer ranges of ``stage``'s local chunks, as the engine splits them (``parallel.pp_layers``)."""
    p = rj.job.parallel
    ranges = partition_layers(rj.model, p.pp, p.virtual_stages, p.pp_layers, seq_len=rj.train.seq_len)
    return stage_layer_ranges(ranges, p.pp, stage, placement_for(p.schedule, p.pp, p.virtual_stages))


def _stage_layers(rj: ResolvedJob, stage: int) -> int:
    return sum(b - a for a, b in _chunk_ranges(rj, stage))


def _activation_bytes(rj: ResolvedJob, stage: int, layers: int, nccl: bool) -> int | None:
    """The planner's estimate for the job's kernels (``meta_kernels.job_runs_fused_kernels``) and the p2p
    semantics the step runs (``nccl``: a send reported complete without a wait, so interleaved schedules free
    their sent outputs; ``for_model`` ties that to the kernels, but a CPU job emulating NCCL runs the fused
    kernels' p2p with the torch ones), given this stage's own chunks (exact for uneven ones), or None where
    the planner has none for this model."""
    _, layout, _ = layout_from_job(rj.job, ClusterSpec.build(rj.world_size, 1))
    try:
        fused = job_runs_fused_kernels(rj.model.backend, rj.job.train.device)
        assumptions = dataclasses.replace(
            ActivationAssumptions.for_model(rj.model, layout.precision, "fused" if fused else "torch"),
            sends_complete_unwaited=nccl, batch_on_host=batch_on_host(rj), document_ids=rj.data.document_mask)
        chunks = [list(range(a, b)) for a, b in _chunk_ranges(rj, stage)]
        return int(stage_activation_bytes(rj.model, layout, stage, layers, assumptions, chunks)[0])
    except ValueError:  # e.g. mixed blocks (a MoE model's dense first layers): the estimate assumes one block
        return None


def _build(rj: ResolvedJob, pstate) -> tuple[list[torch.nn.Module], ZeroOptimizer]:
    chunks = build_chunks(rj, pstate)
    return chunks, build_optimizer(rj, chunks, pstate)


def _step_messages(rj: ResolvedJob, pstate, stage: int, report: RankReport, first, split: bool) -> Counts:
    """Run the step (reduced when ``reduced_microbatches`` allows; ``step`` module doc), fill the
    report's measured activation peak and step sizes; the step's messages at the full count. ``split``: the
    stage's backwards are split (``W`` actions); with gradients reduce-scattered during backward (ZeRO 2 or 3,
    dense or experts) its reduce-scatters follow the order of its ``W`` actions, which two reduced steps do not
    tell even when their counts look linear (fuzz case 2084, ZB-V ZeRO 2: 4 and 5 microbatches extrapolate to 84
    reduce-scatters at 6, the full step sends 88): the full step runs."""
    p, m = rj.job.parallel, rj.grad_accum
    order_bound = split and max(rj.zero.zero_stage, rj.zero.expert_zero_stage or 0) >= 2
    reduced = None if order_bound else reduced_microbatches(
        p.schedule, p.pp, m, p.virtual_stages, stage, rj.pipeline.splits_drain(rj.train.recompute), job_w_lags(rj))
    if reduced is not None:
        a = run_step(rj, pstate, *first, reduced[0])
        b = run_step(rj, pstate, *_build(rj, pstate), reduced[1])  # fresh, so both are a first step
        try:
            counts = extrapolate(a, b, m)
        except NotLinear:  # the full step then, on fresh chunks (step module doc)
            first = _build(rj, pstate)
        else:
            report.step_microbatches = list(reduced)
            report.activation_bytes = a.peak_at(m)
            return counts
    full = run_step(rj, pstate, *first, m)
    report.step_microbatches = [m]
    report.activation_bytes = full.peak_activation_bytes
    return full.messages


def _fill(report: RankReport, rj: ResolvedJob, nccl: bool) -> None:
    p = rj.job.parallel
    with fake_rank_state(rj.topology, report.rank, nccl) as pstate:
        report.coords = {d: pstate.coord(d) for d in ("tp", "cp", "ep", "dp", "pp") if pstate.size(d) > 1}
        stage = pstate.coord("pp")
        chunks, optimizer = _build(rj, pstate)
        report.params = sum(q.numel() for c in chunks for q in c.parameters())
        held = optimizer.memory.current
        report.param_bytes, report.grad_bytes = held["model_weights"], held["gradients"]
        report.optimizer_state_bytes = held["master_weights"] + held["optimizer_moments"]
        report.offloaded_bytes = held["offload_host"] + held["offload_disk"]
        report.layers = _stage_layers(rj, stage)
        actions = build_schedule(p.schedule, p.pp, rj.grad_accum, p.virtual_stages, coalesced_p2p=nccl,
                                 split_drain=rj.pipeline.splits_drain(rj.train.recompute))[stage]
        report.actions = {k: sum(a.kind == k for a in actions) for k in COMPUTE_KINDS
                          if any(a.kind == k for a in actions)}
        report.activation_bytes_planner = _activation_bytes(rj, stage, report.layers, nccl)
        counts = _step_messages(rj, pstate, stage, report, (chunks, optimizer), splits_backward(actions))
    report.messages = [Messages(f"{kind} {op}", calls, nbytes, "step")
                       for (kind, op), (calls, nbytes) in sorted(counts.items())]


def dry_run_rank(rj: ResolvedJob, rank: int, nccl: bool | None = None) -> RankReport:
    """``rank``'s report; a failure anywhere is caught into ``error`` (one line naming the rank). ``nccl``: the p2p
    semantics to run the step with (``fake_world.fake_rank_state``); None: the job's own (``runs_on_nccl``)."""
    report = RankReport(rank=rank)
    try:
        check_dry_runnable(rj.zero.offload)
        _fill(report, rj, runs_on_nccl(rj.job.train.device) if nccl is None else nccl)
    except Exception as exc:  # noqa: BLE001 - the dry run reports every rank's failure, one line each
        cause = (str(exc).strip().splitlines() or [""])[0]
        report.error = f"rank {rank}: {type(exc).__name__}: {cause}"
    return report
