"""Hydra entry points of scripts/plan.py and scripts/estimate_memory.py.

Both compose the training job's config groups (same keys: ``model=...``,
``parallel.*``, ``train.*``) against ``PlanningJob``, which is the training schema
``parallel3d.config.JobConfig`` plus ``cluster.*`` and ``plan.*``; validation of
the shared keys is the training job's own (``parallel3d.config.resolve`` with the
cluster's GPU count as the world size). Output is plain text tables.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from models.config import ModelConfig
from parallel3d.config import (ConfigError, JobConfig, build_model_config, check_no_extra_keys, options_of,
                               register_schema, resolve)
from parallel3d.data.options import DataOptions
from parallel3d.planning.cluster import GiB, ClusterSpec
from parallel3d.planning.layout import Layout
from parallel3d.planning.memory import MemoryEstimate, estimate_memory
from parallel3d.planning.no_fit import nothing_fits
from parallel3d.planning.params import stage_layer_counts
from parallel3d.planning.planner import Candidate, evaluate, job_assumptions, Plan, plan
from parallel3d.planning.request import PlanRequest
from parallel3d.planning.zb_lags import zb_h1_w_lags
from parallel3d.preflight import check_writable_file
from parallel3d.pipeline.partition import partition_layers, stage_layer_ranges
from parallel3d.pipeline.placement import placement_for
from parallel3d.topology import LayoutError
from parallel3d.train_options import TrainOptions

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


@dataclass
class ClusterConfig:
    gpus: int = 1024
    gpus_per_node: int = 8
    device: str = "a100_80gb"
    device_mem: Optional[str] = None
    peak_tflops: Optional[float] = None
    intra_node_gbps: Optional[float] = None
    inter_node_gbps: Optional[float] = None


@dataclass
class PlanOptions:
    top_k: int = 10
    micro_batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    max_virtual_stages: int = 4
    zero_stages: list[int] = field(default_factory=lambda: [1, 2, 3])
    offload: list[str] = field(default_factory=lambda: ["none"])
    memory_fraction: float = 0.9
    simulate_top: int = 24
    json: Optional[str] = None
    kernels: str = "fused"
    uneven_stages: bool = True
    max_cp: int = 1
    schedules: list[str] = field(default_factory=lambda: ["1f1b", "interleaved_1f1b", "zb_h1"])
    explain: bool = False  # also compare the job's own layout (parallel.*, train.*) with the best, term by term


@dataclass
class PlanningJob(JobConfig):
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    plan: PlanOptions = field(default_factory=PlanOptions)


def register_planning_schema() -> None:
    from hydra.core.config_store import ConfigStore

    register_schema()
    ConfigStore.instance().store(name="planning_schema", node=PlanningJob)


def run_app(config_name: str, run: Callable[["PlanningJob"], str],
            note: Optional[Callable[[list[str], "PlanningJob"], Optional[str]]] = None) -> None:
    """The scripts' shared Hydra entry: compose ``conf/<config_name>.yaml`` with the command
    line's overrides, print ``run(job)``; a bad key or layout prints ``error: ...`` and exits 2.
    ``note(args, job)``: a line printed to stderr before ``run`` (e.g. keys it does not read)."""
    import hydra
    from omegaconf import DictConfig, OmegaConf

    register_planning_schema()
    try:
        check_overrides(sys.argv[1:], config_name)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)

    @hydra.main(version_base=None, config_path=str(CONF_DIR), config_name=config_name)
    def main(cfg: DictConfig) -> None:
        job = OmegaConf.to_object(cfg)
        line = note(sys.argv[1:], job) if note else None
        if line:
            print(line, file=sys.stderr, flush=True)
        try:
            print(run(job))
        except (ConfigError, LayoutError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            sys.exit(2)

    main()


def check_overrides(args: list[str], config_name: str) -> None:
    """Compose ``args`` as ``hydra.main`` will (``parallel3d.command_line``), so an unknown key or a wrong
    type is one ``ConfigError`` line, not Hydra's multi-line report with exit 1."""
    from omegaconf import OmegaConf

    from parallel3d import command_line

    cmd = command_line.parse(list(args), str(CONF_DIR), config_name)
    if cmd is None or not cmd.check:  # argparse rejected it (Hydra says why), or shell completion
        return
    for job_overrides in command_line.expand_jobs(cmd).jobs[:command_line.MAX_CHECKED_JOBS]:
        cfg = command_line.compose(cmd, job_overrides)
        check_no_extra_keys(cfg, PlanningJob)
        try:
            OmegaConf.to_object(cfg)
        except Exception as exc:  # noqa: BLE001 - OmegaConf's many error types: all config problems here
            raise ConfigError(command_line.one_line(exc)) from None


def split_device_mem_flag(argv: list[str]) -> list[str]:
    """Turn ``--device-mem 80GB`` / ``--device-mem=80GB`` into the override ``cluster.device_mem=80GB``."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--device-mem":
            if i + 1 >= len(argv):
                raise SystemExit("--device-mem needs a value, e.g. --device-mem 80GB")
            out.append(f"cluster.device_mem={argv[i + 1]}")
            i += 2
            continue
        if arg.startswith("--device-mem="):
            out.append(f"cluster.device_mem={arg.split('=', 1)[1]}")
        else:
            out.append(arg)
        i += 1
    return out


def cluster_from(cfg: ClusterConfig) -> ClusterSpec:
    return ClusterSpec.build(
        cfg.gpus, cfg.gpus_per_node, cfg.device, device_mem=cfg.device_mem, peak_tflops=cfg.peak_tflops,
        intra_node_gbps=cfg.intra_node_gbps, inter_node_gbps=cfg.inter_node_gbps,
    )


def layout_from_job(job: JobConfig, cluster: ClusterSpec) -> tuple[ModelConfig, Layout, list[int]]:
    """The model, the layout and the layers per stage that training would use on ``cluster``."""
    rj = resolve(job, world_size=cluster.gpus)
    return rj.model, _layout_of(rj), [sum(chunks) for chunks in job_chunk_layers(rj)]


def _layout_of(rj) -> Layout:
    """Resolved job ``rj``'s layout, as the planner's ``Layout``."""
    dims, pipe, zero, t = rj.dims, rj.pipeline, rj.zero, rj.train
    return Layout(
        tp=dims.tp, pp=dims.pp, dp=int(dims.dp), zero_stage=zero.zero_stage, sequence_parallel=dims.sequence_parallel,
        schedule=pipe.schedule, virtual_stages=pipe.virtual_stages, split_drain=pipe.split_drain,
        micro_batch_size=t.micro_batch_size,
        seq_len=t.seq_len, global_batch_size=t.global_batch_size, recompute=t.recompute, precision=t.precision,
        grad_reduce_dtype=zero.grad_reduce_dtype, offload=zero.offload, zero3_prefetch=zero.zero3_prefetch,
        zero3_reshard=zero.zero3_reshard, cp=dims.cp, cp_comm=rj.context_parallel.cp_comm,
        cp_a2a_size=rj.context_parallel.cp_a2a_size, ep=dims.ep, etp=dims.etp,
        expert_zero_stage=zero.expert_zero_stage,
    )


def job_chunk_layers(rj) -> list[list[int]]:
    """Layers of each (stage, local chunk) of resolved job ``rj``, split as ``rank_build`` splits them (its
    ``parallel.pp_layers``, else balanced at ``train.seq_len``) and placed as its schedule places chunks
    (zbv's V: stage 0 holds the first and the last model chunk)."""
    pp, v = rj.dims.pp, rj.pipeline.virtual_stages
    ranges = partition_layers(rj.model, pp, v, rj.pipeline.pp_layers, seq_len=rj.train.seq_len)
    placement = placement_for(rj.pipeline.schedule, pp, v)
    return [[b - a for a, b in stage_layer_ranges(ranges, pp, s, placement)] for s in range(pp)]


def job_candidate(job: JobConfig, cluster: ClusterSpec) -> Candidate:
    """The job's own layout (``parallel.*``, ``train.*``) priced as training would run it, its layer split
    included (``plan.explain``); a layout training refuses raises the training validator's error."""
    rj = resolve(job, world_size=cluster.gpus)
    return evaluate(rj.model, _layout_of(rj), cluster, chunk_layers=job_chunk_layers(rj),
                    document_mask=rj.data.document_mask)


def job_w_lags(rj) -> tuple[int, ...] | None:
    """zb_h1's per-stage ``W`` lags for resolved job ``rj`` (``zb_lags.zb_h1_w_lags`` on the layout training
    uses; None for other schedules): what the trainer and the dry run hand the engine."""
    if rj.pipeline.schedule != "zb_h1":
        return None
    model, layout, _ = layout_from_job(rj.job, ClusterSpec.build(rj.world_size, 1))
    return zb_h1_w_lags(model, layout)


def _gib(x: float) -> str:
    return f"{x / GiB:8.2f}"


def format_memory(estimate: MemoryEstimate, device_bytes: float) -> str:
    worst = estimate.worst
    lay = estimate.layout
    lines = [
        f"model {estimate.config.name or estimate.config.arch}: {lay.short()} schedule={lay.schedule} "
        f"seq={lay.seq_len} gbs={lay.global_batch_size} precision={lay.precision}",
        f"worst rank: pipeline stage {worst.stage} ({worst.params:,} parameters, "
        f"{worst.inflight} microbatch-chunks in flight)",
        "",
        f"{'category':<20}{'GiB':>8}",
    ]
    for category, value in worst.by_category().items():
        lines.append(f"{category:<20}{_gib(value)}")
    lines.append(f"{'total':<20}{_gib(worst.total)}")
    lines += ["", f"{'stage':>5} {'params':>15} {'in-flight':>9} {'states GiB':>10} {'activ. GiB':>10} {'total GiB':>9}"]
    for s in estimate.stages:
        states = s.total - s.activations
        lines.append(f"{s.stage:>5} {s.params:>15,} {s.inflight:>9} {_gib(states):>10} {_gib(s.activations):>10} "
                     f"{_gib(s.total):>9}")
    if worst.host or worst.disk:
        lines.append(f"offloaded: {worst.host / GiB:.2f} GiB in host memory, {worst.disk / GiB:.2f} GiB on disk "
                     f"(optimizer state; not device memory)")
    verdict = "FITS" if worst.total <= device_bytes else "DOES NOT FIT"
    lines += ["", f"{verdict}: peak {worst.total / GiB:.2f} GiB of {device_bytes / GiB:.2f} GiB device memory "
                  f"({100 * worst.total / device_bytes:.0f}%; CUDA context, NCCL buffers and fragmentation "
                  f"need a few GiB more)"]
    return "\n".join(lines)


PLAN_HEADER = (f"{'#':>3} {'tp':>3} {'pp':>3} {'dp':>5} {'v':>2} {'mbs':>3} {'zero':>5} {'recompute':>9} "
               f"{'mem GiB':>8} {'step s':>8} {'bubble':>6} {'TFLOP/s':>8} {'MFU':>6} {'tokens/s':>11}")


def format_candidate_row(index: str, c) -> str:
    lay, st = c.layout, c.step
    return (f"{index:>3} {lay.tp:>3} {lay.pp:>3} {lay.dp:>5} {lay.virtual_stages:>2} {lay.micro_batch_size:>3} "
            f"{str(lay.zero_stage) + ('c' if lay.offload == 'cpu' else ''):>5} {lay.recompute:>9} "
            f"{c.peak_bytes / GiB:>8.1f} {st.step_time_s:>8.2f} "
            f"{100 * st.bubble_fraction:>5.1f}% {st.tflops_per_gpu:>8.1f} {100 * st.mfu:>5.1f}% "
            f"{st.tokens_per_s():>11,.0f}")


def format_plan(result: Plan, top_k: int) -> str:
    c, r = result.cluster, result.request
    lines = [
        f"model {result.config.name or result.config.arch} on {c.gpus} x {c.device.name} "
        f"({c.gpus_per_node}/node, {c.device.memory_bytes / GiB:.0f} GiB, {c.device.peak_flops / 1e12:.0f} TFLOP/s peak); "
        f"global batch {r.global_batch_size} x {r.seq_len} tokens, {r.precision}",
        f"{result.considered} layouts enumerated, {result.fitting} fit in {100 * r.memory_fraction:.0f}% of device "
        f"memory, {result.simulated} settings simulated (the rest bounded out); "
        f"top {min(top_k, len(result.ranked))} by simulated step time "
        f"(TFLOP/s counts recomputation, MFU does not):",
        "",
        PLAN_HEADER,
    ]
    for i, cand in enumerate(result.ranked[:top_k], 1):
        lines.append(format_candidate_row(str(i), cand))
        w = cand.memory.worst
        lines.append(f"      {cand.layout.short()} {cand.layout.schedule}; memory/rank GiB: weights "
                     f"{w.weights / GiB:.1f} grads {w.gradients / GiB:.1f} master {w.master_weights / GiB:.1f} "
                     f"moments {w.optimizer_moments / GiB:.1f} activations {w.activations / GiB:.1f}")
        lines.append("      step s: " + " ".join(f"{k} {t:.3f}" for k, t in cand.step.breakdown))
        if i < min(top_k, len(result.ranked)):
            lines.append("      next loses: " + why_slower(result.ranked[i], cand))
    if result.ranked:
        lines += ["", "best as overrides: " + result.ranked[0].layout.overrides()]
    else:
        lines += ["", nothing_fits(result)]
    return "\n".join(lines)


def why_slower(worse, better) -> str:
    """One line: the step-time component that grows most from ``better`` to ``worse``."""
    a, b = dict(worse.step.breakdown), dict(better.step.breakdown)
    key = max(a, key=lambda k: a[k] - b[k])
    return (f"+{worse.step.step_time_s - better.step.step_time_s:.3f} s/step, mostly {key} "
            f"({b[key]:.3f} -> {a[key]:.3f} s)")


def plan_json(result: Plan, top_k: int) -> list[dict]:
    return [
        {**c.layout.to_dict(), "splits_drain": c.layout.splits_drain, "stage_layers": stage_layer_counts(result.config, c.layout.pp, c.layout.virtual_stages,
                                                               c.layout.seq_len),
         "memory_bytes": {k: getattr(c.memory.worst, k) for k in
                          ("weights", "gradients", "master_weights", "optimizer_moments", "activations")},
         "tokens_per_s": c.step.tokens_per_s(), "dp_exposed_s": c.step.dp_exposed_s,
         "breakdown_s": dict(c.step.breakdown),
         "peak_bytes": c.peak_bytes, "step_time_s": c.step.step_time_s,
         "bubble_fraction": c.step.bubble_fraction, "tflops_per_gpu": c.step.tflops_per_gpu, "mfu": c.step.mfu}
        for c in result.ranked[:top_k]
    ]


def job_estimate(job: PlanningJob) -> MemoryEstimate:
    """The memory of the job's own layout, its activations priced as the planner prices them (``plan.kernels``'
    profile, ``data.document_mask``'s tensors)."""
    model, layout, stage_layers = layout_from_job(job, cluster_from(job.cluster))
    assumptions = job_assumptions(model, layout.precision, options_of(DataOptions, job.data).document_mask,
                                  job.plan.kernels)
    return estimate_memory(model, layout, assumptions, stage_layers=stage_layers)


def run_estimate(job: PlanningJob) -> str:
    return format_memory(job_estimate(job), cluster_from(job.cluster).device.memory_bytes)


def search(job: PlanningJob, progress: Optional[Callable[[str], None]] = None) -> Plan:
    """The search ``scripts/plan.py`` runs for ``job`` (its cluster, model, train.* and plan.* keys)."""
    cluster = cluster_from(job.cluster)
    model = resolve_model_only(job)
    o = job.plan
    if o.json:  # written after the search: a bad path must not cost it
        check_writable_file("plan.json", o.json)
    request = PlanRequest(
        global_batch_size=job.train.global_batch_size, seq_len=job.train.seq_len, precision=job.train.precision,
        micro_batch_sizes=tuple(o.micro_batch_sizes), max_virtual_stages=o.max_virtual_stages,
        zero_stages=tuple(o.zero_stages), offload_modes=tuple(o.offload), memory_fraction=o.memory_fraction,
        top_k=o.top_k,
        simulate_top=max(o.simulate_top, o.top_k), uneven_stages=o.uneven_stages, max_cp=o.max_cp,
        schedules=tuple(o.schedules), document_mask=options_of(DataOptions, job.data).document_mask,
    )
    return plan(model, cluster, request, progress=progress)


def run_plan(job: PlanningJob) -> str:
    o = job.plan
    # The job's own layout is checked (and priced) before a search that can take minutes, not after it.
    given = job_candidate(job, cluster_from(job.cluster)) if o.explain else None
    result = search(job, progress=lambda line: print(line, file=sys.stderr, flush=True))
    model, cluster = result.config, result.cluster
    if o.json:
        with open(o.json, "w") as f:
            json.dump({"model": model.name, "gpus": cluster.gpus, "device": cluster.device.name,
                       "layouts": plan_json(result, o.top_k)}, f, indent=2)
    text = format_plan(result, o.top_k)
    if given is not None:
        text += "\n\n" + explain(given, result.best, budget=cluster.device.memory_bytes * o.memory_fraction)
    return text


def explain(given, best, budget: Optional[float] = None) -> str:
    """``given`` (a candidate) against ``best``, line by line: the layout keys that differ, then every
    step-time column with the difference, largest loss first; with ``budget`` (bytes a rank may use, the
    search's), a given layout above it is said not to fit (its times are what it would take if it did)."""
    g, b = given.layout.to_dict(), best.layout.to_dict()
    lines = [f"explain: given {given.layout.short()} vs best {best.layout.short()}: "
             f"{given.step.step_time_s:.3f} s vs {best.step.step_time_s:.3f} s per step "
             f"(MFU {100 * given.step.mfu:.1f}% vs {100 * best.step.mfu:.1f}%)",
             "  differs in: " + (", ".join(f"{k} {g[k]} (best {b[k]})" for k in g if g[k] != b.get(k)) or "nothing"),
             f"  drain split (parallel.split_drain): given {given.layout.splits_drain} ({g['split_drain']}), "
             f"best {best.layout.splits_drain} ({b['split_drain']})"]
    gb, bb = dict(given.step.breakdown), dict(best.step.breakdown)
    for key in sorted(gb, key=lambda k: bb.get(k, 0.0) - gb[k]):
        lines.append(f"  {key:>9s}: {gb[key]:9.3f} s  best {bb.get(key, 0.0):9.3f} s  ({gb[key] - bb.get(key, 0.0):+.3f})")
    lines.append(f"  memory/rank: {given.peak_bytes / GiB:.1f} GiB vs {best.peak_bytes / GiB:.1f} GiB")
    if budget is not None and given.peak_bytes > budget:
        lines.append(f"  the given layout DOES NOT FIT: {given.peak_bytes / GiB:.1f} GiB a rank over the search's "
                     f"budget of {budget / GiB:.1f} GiB (plan.memory_fraction of the device's memory)")
    return "\n".join(lines)


def resolve_model_only(job: JobConfig) -> ModelConfig:
    """The model, and the train.* values the planner keeps fixed, checked (the layout is searched)."""
    model = build_model_config(job)
    options_of(TrainOptions, job.train).check_sequence(model.max_seq_len, tp=1, sequence_parallel=False)
    return model


__all__ = ["ClusterConfig", "check_overrides", "PlanOptions", "PlanningJob", "cluster_from", "format_memory",
           "format_plan", "layout_from_job", "register_planning_schema", "run_estimate", "run_plan", "search",
           "split_device_mem_flag"]
