"""The planner against published training runs (``published_runs.yaml``): the held-out table.

For every scored run (split ``calibration`` or ``held_out``) the run's model, cluster and layout
are rebuilt as a ``ModelConfig``, ``ClusterSpec`` and ``Layout``; the cost model times the
published layout and its predicted throughput is turned into an MFU in the *source's own FLOPs
convention* (its attention convention, whether recompute is counted, its peak): predicted
tokens/s per GPU x the FLOPs per token the source counts / the source's peak. The FLOPs per token
is the one the source's own numbers imply where they pin it down (TFLOP/s and tokens/s both
published), else ``models.shape`` under the convention.

A field the source leaves unstated (the row's ``unstated``: virtual stages, schedule, micro-batch) is
priced, in both checks, at the planner's best fitting choice (``priced_candidate``, the one place this
rule lives), since the source presumably ran a tuned setting it did not report; every stated field is
priced as written. ``--split`` tables mark such completed fields with ``*``.

Rows the planner cannot price in the source's terms (fp8, MLA, sliding-window attention, a
schedule the runtime lacks) are listed as skipped with the reason, never silently dropped.

The rank check (``rank_run``) runs the planner's search with the run's global batch, sequence and
precision and asks whether the published layout is in the top 5, or whether every layout above it is
predicted at least as fast within 3% of it (``rank_ok``). Like with like: the search is held at the
source framework's recompute mode, ZeRO stage, sequence parallelism, schedules and (``EVEN_SPLIT_SOURCES``)
even layer splits; a field the source leaves unstated (the row's ``unstated``: virtual stages, schedule,
micro-batch) is priced at the planner's best allowed choice (``priced_candidate``), not at the data file's
placeholder; a degree the source says its experiment held fixed (``rank_fixed``, with the source's words) is
held in the search.

Invariant: nothing here is fitted per run; the only tuned numbers live in the device YAMLs and
``CostOptions``, and were set on the ``calibration`` rows only.
``python -m parallel3d.planning.validation [--split held_out|calibration|all] [--rank]`` prints it.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from models.config import ModelConfig
from models.moe_config import MoEConfig
from parallel3d.planning.cluster import ClusterSpec
from parallel3d.planning.cost import CostOptions, StepEstimate, estimate_step
from parallel3d.option_checks import ConfigError
from parallel3d.planning.layout import Layout, check_fits_model
from parallel3d.planning.params import stage_layer_counts
from parallel3d.planning.planner import (Candidate, evaluate, finest_virtual_stages, layout_memory, plan,
                                         schedule_choices, step_bound)
from parallel3d.planning.request import PlanRequest
from parallel3d.planning.schedule_cache import ScheduleCache
from parallel3d.planning.published import load_published_runs
from parallel3d.planning.published_schema import PublishedRun
from parallel3d.planning.source_frameworks import (interleaved_min_pp, rank_fixed_degrees, run_options,
                                                   source_flops_per_token, source_peak_flops, uneven_splits_allowed)
from parallel3d.topology import LayoutError

MFU_TOLERANCE = 0.10  # relative, the bar
RANK_TOP = 5
RANK_SLACK = 0.03
SCORED_SPLITS: tuple[str, ...] = ("calibration", "held_out")
# The schedules the published runs' frameworks (Megatron-LM 2021-24, Megatron-Core, torchtitan) offered.
RANK_SCHEDULES: tuple[str, ...] = ("1f1b", "interleaved_1f1b")
PRICEABLE_SCHEDULES = {"none": "1f1b", "1f1b": "1f1b", "interleaved_1f1b": "interleaved_1f1b"}


class Unpriceable(ValueError):
    """The run uses something the cost model cannot price in the source's terms."""


def run_config(run: PublishedRun) -> ModelConfig:
    """The run's model as a ``ModelConfig`` (raises ``Unpriceable`` for what the shape module lacks)."""
    m = run.model
    if m.mla is not None or m.attention in ("mla", "gqa_swa"):
        raise Unpriceable(f"attention={m.attention} (no MLA / sliding-window shape)")
    if m.head_dim is not None and m.head_dim * m.heads != m.hidden:
        raise Unpriceable(f"head_dim={m.head_dim} != hidden/heads")
    # squared-ReLU (Nemotron) has the gelu MLP's two matrices and FLOPs; only the activation differs.
    arch = "llama" if m.mlp == "swiglu" else "gpt"
    moe = MoEConfig()
    if m.moe is not None:
        moe = MoEConfig(num_experts=m.moe.experts, top_k=m.moe.top_k, ffn_hidden_size=m.moe.expert_ffn,
                        num_shared_experts=m.moe.shared_experts,
                        shared_ffn_hidden_size=m.moe.shared_expert_ffn or None,
                        dense_first=m.moe.dense_layers, capacity_factor=m.moe.capacity_factor)
    return ModelConfig(arch=arch, num_layers=m.layers, hidden_size=m.hidden, num_heads=m.heads,
                       num_kv_heads=m.kv_heads, ffn_hidden_size=m.ffn, vocab_size=m.vocab,
                       max_seq_len=run.batch.seq_len, tie_embeddings=m.tied_embeddings,
                       use_bias=arch == "gpt", name=m.name, moe=moe)


def run_layout(run: PublishedRun) -> Layout:
    lay = run.layout
    if lay.precision not in ("fp16", "bf16"):
        raise Unpriceable(f"precision={lay.precision}")
    if lay.schedule not in PRICEABLE_SCHEDULES:
        raise Unpriceable(f"schedule={lay.schedule}")
    schedule = PRICEABLE_SCHEDULES[lay.schedule]
    return Layout(tp=lay.tp, pp=lay.pp, dp=lay.dp, cp=lay.cp, cp_comm=lay.cp_comm if lay.cp > 1 else "p2p", ep=lay.ep,
                  etp=None if lay.etp == lay.tp else lay.etp, zero_stage=lay.zero_stage,
                  sequence_parallel=lay.sequence_parallel and lay.tp > 1, schedule=schedule,
                  virtual_stages=lay.vp, micro_batch_size=lay.micro_batch, seq_len=run.batch.seq_len,
                  global_batch_size=run.batch.global_batch, recompute=lay.recompute, precision=lay.precision)


def run_cluster(run: PublishedRun) -> ClusterSpec:
    hw = run.hardware
    return ClusterSpec.build(hw.gpus, hw.gpus_per_node, hw.device)


@dataclass(frozen=True)
class RowResult:
    run: PublishedRun
    published_mfu: float | None
    predicted_mfu: float | None
    skipped: str = ""  # why the row is not scored
    rank: int | None = None  # 1-based position of the published layout in the search (None: not run)
    rank_ok: bool | None = None
    rank_gap: float | None = None  # predicted step time over the best searched layout's, minus 1
    rank_why: str = ""  # where the published layout loses to the best one found, by step-time column
    priced: Layout | None = None  # the layout both checks priced (``priced_candidate``)

    @property
    def error(self) -> float | None:
        if self.published_mfu is None or self.predicted_mfu is None:
            return None
        return (self.predicted_mfu - self.published_mfu) / self.published_mfu

    @property
    def mfu_ok(self) -> bool:
        return self.error is not None and abs(self.error) <= MFU_TOLERANCE


def rank_reason(published: StepEstimate, best: StepEstimate) -> str:
    """One line: the best layout found and the step-time columns (``StepEstimate.breakdown``) in which
    the published layout loses most to it, largest first (seconds per step)."""
    a, b = dict(published.breakdown), dict(best.breakdown)
    losses = sorted(((a[k] - b.get(k, 0.0), k) for k in a), reverse=True)
    terms = ", ".join(f"{k} +{d:.2f} s" for d, k in losses[:3] if d > 0)
    return f"best {best.layout.short()}: published loses in {terms or 'nothing'}"


def rank_search(config: ModelConfig, cluster: ClusterSpec, step: StepEstimate, options: CostOptions,
                request: PlanRequest) -> tuple[int, bool, float, str]:
    """(position of the published step among the layouts ``request`` searches, whether it passes the
    issue's rank rule, how much slower than the best found it is predicted: 0.05 = 5%; ``_rank_rule``)
    plus ``rank_reason`` against the best layout found ('' when it is the best)."""
    ranked = plan(config, cluster, request, options).ranked
    faster = [c for c in ranked if c.step.step_time_s < step.step_time_s]
    position, ok, gap = _rank_rule(step.step_time_s, faster)
    return position, ok, gap, rank_reason(step, faster[0].step) if faster else ""


def run_rank_request(run: PublishedRun, config: ModelConfig | None = None) -> PlanRequest:
    """The search the rank rule holds ``run`` against, like with like: ``_rank_request`` at the run's
    published layout, with the degrees its source held fixed (``rank_fixed_degrees``), even splits only
    where its framework had them (``uneven_splits_allowed``) and interleaving from the depth its framework
    allowed (``interleaved_min_pp``)."""
    config = config or run_config(run)
    return _rank_request(run_layout(run), config.num_layers, rank_fixed_degrees(run),
                         uneven_splits_allowed(run, config), interleaved_min_pp(run))


def _rank_request(layout: Layout, num_layers: int, fixed: tuple[tuple[str, int], ...] = (),
                  uneven: bool = True, min_interleaved_pp: int = 2) -> PlanRequest:
    # The source's framework settings (recompute mode, ZeRO stage, sequence parallelism) are held at
    # the published ones, and only the schedules those frameworks had (1F1B, interleaved) are searched:
    # the check ranks the *layout* (tp, cp, ep, pp, vp, dp, micro-batch) among what the source could have
    # run. One recompute x one ZeRO stage per layout instead of up to 3 x 3 also keeps it fast.
    # Virtual stages: the planner's one rule (``planner.virtual_stage_counts``) with the cap raised to the
    # published v and to one layer per chunk at the published depth (``planner.finest_virtual_stages``):
    # Megatron-LM interleaves down to one layer per virtual stage, and the default cap (4) is only a
    # search-cost choice that left a 7-layer stage (GPT 462B, Mixtral at pp 8) 1F1B or 4 unequal chunks,
    # a bubble a source free to pick v never had. The raised cap applies to every depth searched.
    finest = finest_virtual_stages(num_layers, layout.pp, uneven) if layout.pp > 1 else 1
    return PlanRequest(global_batch_size=layout.global_batch_size, seq_len=layout.seq_len,
                       precision=layout.precision, top_k=RANK_TOP, simulate_top=16,
                       recompute_modes=(layout.recompute,), zero_stages=(layout.zero_stage,),
                       max_cp=max(1, layout.cp), schedules=RANK_SCHEDULES,
                       sequence_parallel=layout.sequence_parallel, fixed_degrees=fixed, uneven_stages=uneven,
                       min_interleaved_pp=min_interleaved_pp,
                       max_virtual_stages=max(PlanRequest.max_virtual_stages, layout.virtual_stages, finest))


def completed_layout(run: PublishedRun, config: ModelConfig, layout: Layout, cluster: ClusterSpec,
                     options: CostOptions, uneven: bool = True, min_interleaved_pp: int = 2,
                     schedules: ScheduleCache | None = None) -> Candidate:
    """The published layout as the rank check prices it: each field the source leaves unstated
    (``run.unstated``: virtual stages, schedule, micro-batch) at the planner's best allowed choice
    (the choices ``_rank_request``'s search would try for these degrees, fitting memory), every stated
    field as published. The placeholder written in the data file stays a candidate, so a completion is
    never slower than it; with nothing unstated this is ``evaluate`` of the layout as written.

    Why: the search picks v and the micro-batch for every layout it ranks, so pricing the published
    degrees at a default the source never stated (v = 1: a 1F1B bubble) compares a chosen layout with an
    unchosen one. ``schedules``: the caller's built schedules (``validate`` shares one over its rows: a
    schedule depends on (p, m, v, ...) alone, and the rows and their completions share many)."""
    schedules = ScheduleCache.of(schedules)
    free = set(run.unstated)
    if not free:
        return evaluate(config, layout, cluster, options, schedules)
    request = _rank_request(layout, config.num_layers, uneven=uneven, min_interleaved_pp=min_interleaved_pp)
    budget = cluster.device.memory_bytes * request.memory_fraction
    mbs_choices = request.micro_batch_sizes if "layout.micro_batch" in free else (layout.micro_batch_size,)
    # (step-time lower bound, place, layout, memory, split): the placeholder first (place -1, kept whatever
    # its memory), then every fitting choice in the search's order (one equal to the placeholder cannot beat it)
    trials = [_bounded(config, layout, cluster, options, schedules, -1)]
    for mbs in mbs_choices:
        if layout.global_batch_size % (layout.dp * mbs):
            continue
        m = layout.global_batch_size // (layout.dp * mbs)
        for schedule, v in schedule_choices(config, layout.pp, m, request):
            if ("layout.schedule" not in free and schedule != layout.schedule) or \
                    ("layout.vp" not in free and v != layout.virtual_stages):
                continue
            try:
                trial = layout.replace(micro_batch_size=mbs, schedule=schedule, virtual_stages=v)
                check_fits_model(config, trial)
                bounded = _bounded(config, trial, cluster, options, schedules, len(trials))
            except (ConfigError, LayoutError, ValueError):
                continue
            if bounded[3].peak_bytes <= budget and trial != layout:
                trials.append(bounded)
    # The answer is the least (full price, place): a choice must be strictly faster than the placeholder, and
    # the earliest of equals wins. The full price simulates the schedule, so the trials go in the order of their
    # bounds (``step_bound``, never above the full price: ``plan`` relies on the same) and stop at the first
    # bound above the best price found: same answer, a fifth of the simulations (session 46 profile of
    # ``validate('held_out')``: 283 evaluations -> 86 simulated).
    best, best_key = None, (float("inf"), 0)
    for bound, place, trial, memory, splits in sorted(trials, key=lambda t: t[:2]):
        if bound > best_key[0]:
            break
        try:
            step = estimate_step(config, trial, cluster, options, splits, schedules=schedules)
        except (ConfigError, LayoutError, ValueError):
            if place < 0:
                raise  # the layout as written: its error is the row's (``validate_run`` reports it)
            continue
        if (step.step_time_s, place) < best_key:
            best, best_key = Candidate(trial, memory, step, simulated=True), (step.step_time_s, place)
    return best


def _bounded(config: ModelConfig, layout: Layout, cluster: ClusterSpec, options: CostOptions,
             schedules: ScheduleCache, place: int) -> tuple:
    """``completed_layout``'s trial: (``step_bound``, place, layout, ``evaluate``'s memory, the engine's split)."""
    splits = stage_layer_counts(config, layout.pp, layout.virtual_stages, layout.seq_len)
    memory = layout_memory(config, layout, options, schedules, splits)
    try:
        bound = step_bound(config, layout, cluster, options)
    except (ConfigError, LayoutError, ValueError):
        bound = float("-inf")  # no bound: the full price decides
    return bound, place, layout, memory, splits


def priced_candidate(run: PublishedRun, options: CostOptions | None = None,
                     cluster: ClusterSpec | None = None, schedules: ScheduleCache | None = None) -> Candidate:
    """The published layout as *both* checks price it (MFU and rank; also the calibration fit):
    ``completed_layout`` with the run's own split rule, i.e. fields the source leaves unstated at the
    planner's best fitting choice, since the source presumably ran a tuned setting it did not report.
    The one place this rule lives."""
    options = options or run_options(run)
    config, layout = run_config(run), run_layout(run)
    cluster = cluster or run_cluster(run)
    return completed_layout(run, config, layout, cluster, options, uneven_splits_allowed(run, config),
                            interleaved_min_pp(run), schedules)


def rank_run(run: PublishedRun, options: CostOptions | None = None,
             published: Candidate | None = None) -> tuple[int, bool, float, str]:
    """The issue's rank rule for one run: its layout, completed where the source is silent
    (``priced_candidate``; pass it as ``published`` if already priced), against the search held where
    the source says its experiment was (``run_rank_request``). Returns ``rank_search``'s
    (position, ok, gap, why)."""
    options = options or run_options(run)
    config, layout, cluster = run_config(run), run_layout(run), run_cluster(run)
    published = published or priced_candidate(run, options, cluster)
    position, ok, gap, why = rank_search(config, cluster, published.step, options, run_rank_request(run, config))
    if published.layout != layout:
        why = f"published completed as {published.layout.short()}" + (f"; {why}" if why else "")
    return position, ok, gap, why


def _rank_rule(step_time: float, faster: list) -> tuple[int, bool, float]:
    position = len(faster) + 1
    # Outside the top 5 it still passes when every layout above it is predicted at most 3% faster,
    # i.e. the published layout is within 3% of the best one found.
    ok = position <= RANK_TOP or step_time <= faster[0].step.step_time_s * (1 + RANK_SLACK)
    gap = step_time / faster[0].step.step_time_s - 1 if faster else 0.0
    return position, ok, gap


def unscored_reason(run: PublishedRun) -> str | None:
    """Why ``validate_run`` cannot score ``run`` without pricing it (no model, layout or cluster the
    planner can build; no published MFU), else None. Cheap: no search runs."""
    try:
        run_config(run), run_layout(run), run_cluster(run)
    except Unpriceable as exc:
        return str(exc)
    return None if run.mfu is not None else "no published MFU or TFLOP/s"


def validate_run(run: PublishedRun, options: CostOptions | None = None, with_rank: bool = False,
                 schedules: ScheduleCache | None = None) -> RowResult:
    options = options or run_options(run)
    reason = unscored_reason(run)
    if reason is not None:
        return RowResult(run, run.mfu, None, skipped=reason)
    published, config, cluster = run.mfu, run_config(run), run_cluster(run)
    try:
        cand = priced_candidate(run, options, cluster, schedules)
    except (LayoutError, ValueError) as exc:  # e.g. more chunks than layers: a split the runtime lacks
        return RowResult(run, published, None, skipped=str(exc).split("; ")[0][:90])
    tokens_per_s_gpu = cand.step.tokens_per_s() / cluster.gpus
    predicted = tokens_per_s_gpu * source_flops_per_token(run, config) / source_peak_flops(run, cluster)
    rank = ok = gap = None
    why = ""
    if with_rank:
        rank, ok, gap, why = rank_run(run, options, cand)
    return RowResult(run, published, predicted, rank=rank, rank_ok=ok, rank_gap=gap, rank_why=why,
                     priced=cand.layout)


def validate(split: str = "held_out", with_rank: bool = False,
             options: CostOptions | None = None) -> list[RowResult]:
    splits = SCORED_SPLITS if split == "all" else (split,)
    schedules = ScheduleCache()  # the pricing's schedules, shared by the rows (each rank search keeps its own)
    return [validate_run(r, options, with_rank, schedules) for r in load_published_runs() if r.split in splits]


def summary(rows: list[RowResult]) -> tuple[int, float, float]:
    """(scored rows, mean |error|, worst |error|) over the rows that were priced."""
    errors = [abs(r.error) for r in rows if r.error is not None]
    if not errors:
        return 0, 0.0, 0.0
    return len(errors), sum(errors) / len(errors), max(errors)


def format_rows(rows: list[RowResult]) -> str:
    lines = [f"{'run':38s} {'split':11s} {'GPUs':>5s} {'layout':28s} {'pub MFU':>7s} {'pred':>6s} "
             f"{'err':>7s} {'rank':>5s} {'gap':>6s}  ok"]
    for r in rows:
        lay = r.run.layout
        vp, mbs = lay.vp, lay.micro_batch
        if r.priced is not None:  # a '*' marks a field completed at the planner's choice (``unstated``)
            vp = f"{r.priced.virtual_stages}{'*' if 'layout.vp' in r.run.unstated else ''}"
            mbs = f"{r.priced.micro_batch_size}{'*' if 'layout.micro_batch' in r.run.unstated else ''}"
        text = f"tp{lay.tp} pp{lay.pp} vp{vp} cp{lay.cp} ep{lay.ep} dp{lay.dp} m{mbs}"
        if r.skipped:
            lines.append(f"{r.run.id:38s} {r.run.split:11s} {r.run.hardware.gpus:5d} {text:28s} skipped: {r.skipped}")
            continue
        rank = "-" if r.rank is None else str(r.rank)
        gap = "-" if r.rank_gap is None else f"{100 * r.rank_gap:+.1f}%"
        ok = r.mfu_ok and r.rank_ok is not False
        lines.append(f"{r.run.id:38s} {r.run.split:11s} {r.run.hardware.gpus:5d} {text:28s} "
                     f"{100 * r.published_mfu:6.1f}% {100 * r.predicted_mfu:5.1f}% {100 * r.error:+6.1f}% "
                     f"{rank:>5s} {gap:>6s}  {'yes' if ok else 'MISS'}")
        if r.rank_ok is False:
            lines.append(f"{'':38s}   rank: {r.rank_why}")
    n, mean, worst = summary(rows)
    lines.append(f"scored {n} rows: mean |MFU error| {100 * mean:.1f}%, worst {100 * worst:.1f}% "
                 f"(bar: {100 * MFU_TOLERANCE:.0f}%)")
    return "\n".join(lines)


def rank_summary(rows: list[RowResult]) -> str:
    """One line: how many ranked rows pass the rank rule."""
    ranked = [r for r in rows if r.rank_ok is not None]
    passed = sum(r.rank_ok for r in ranked)
    return (f"rank check: {passed} of {len(ranked)} rows have the published layout in the top {RANK_TOP} "
            f"or within {100 * RANK_SLACK:.0f}% of the best layout found")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallel3d.planning.validation", description=__doc__.split("\n")[0])
    parser.add_argument("--split", choices=("held_out", "calibration", "all"), default="held_out")
    parser.add_argument("--rank", action="store_true", help="also run the search per row (slow for large runs)")
    args = parser.parse_args(argv)
    rows = validate(args.split, args.rank)
    print(format_rows(rows))
    if args.rank:
        print(rank_summary(rows))
    return 0 if all(r.skipped or (r.mfu_ok and r.rank_ok is not False) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
