"""Layout planner: enumerate layouts for a cluster, drop those that do not fit, rank by step time.

Search space (for a fixed model, cluster, global batch, sequence and precision):
tp a power of two up to ``gpus_per_node`` that divides the heads, the KV
heads and the FFN width (tensor parallelism stays inside a node's NVLink);
pp a divisor of ``num_layers`` (or, with ``uneven_stages``, any depth whose
balanced stages differ by at most ~10%) whose tp*pp divides the GPUs; dp the rest;
micro-batch sizes that divide the per-replica batch; for MoE models ep, etp (the dense tp or 1)
and the expert ZeRO stage (the dense one or a higher searched one); 1F1B, zero-bubble zb_h1
(pp > 1: same activation peak on the first stage, a smaller bubble, its split
backward priced by the simulator), and interleaved 1F1B with v chunks per stage (v up to
``max_virtual_stages``, and one layer per chunk: ``virtual_stage_counts``)
when v*pp divides the layers (with ``uneven_stages``: when the layers fill every chunk but the first and
the last, which may hold the embedding or the head alone, as in Llama 3 405B's 128 chunks of 126 layers) (GPipe is not searched: 1F1B's time with more memory). Sequence
parallelism is on whenever tp > 1 (same communication volume, less memory). ``fixed_degrees`` holds
named degrees at given values (the published-run rank check holds what a source's experiment held).
For each, the cheapest recompute mode (none < selective < full) and the fastest
ZeRO stage (1, 2, 3 by default) and offload mode (``none``; ``cpu`` when asked:
``plan.offload=[none,cpu]``) that fit the device memory are kept. A recompute
mode is given up for a more expensive one only if nothing fits without offload
(offloading is usually slower than recomputing). ``disk`` offload is not
searched: it needs a directory, and the planner does not model host or disk
capacity.

Ranking is two-pass so large searches stay fast, and one rule decides it: every fitting setting gets
a lower bound of its step time (``cost.estimate_step`` with ``pipeline_price.pipeline_lower_bound``:
for uniform 1F1B / interleaved stages the closed form (v m + p - 1) chunk slots; DP traffic hidden as
far as any chunk order could hide it), then settings are re-timed by the full price (the simulated
schedule, zb_h1's W lags, each chunk's own DP overlap) in the order of their bounds until the next
bound exceeds the ``simulate_top``-th best full price. So the ranked top is exactly the full price's:
no layout is dropped by a pre-ranking that disagrees with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from models.config import ModelConfig
from parallel3d.planning.activations import ActivationAssumptions
from parallel3d.planning.cluster import ClusterSpec
from parallel3d.planning.cost import CostOptions, StepEstimate, chunk_layer_counts, estimate_step
from parallel3d.planning.pipeline_price import pipeline_lower_bound
from parallel3d.context_parallel.attention import CP_COMM_VARIANTS
from parallel3d.option_checks import ConfigError
from parallel3d.pipeline.options import INTERLEAVED, SCHEDULES, PipelineOptions
from parallel3d.planning.layout import Layout, check_fits_model
from parallel3d.topology import LayoutError, fewest_layers
from parallel3d.planning.memory import MemoryEstimate, estimate_memory
from parallel3d.planning.params import stage_layer_counts
from parallel3d.planning.request import RECOMPUTE_ORDER, PlanRequest
from parallel3d.planning.schedule_cache import ScheduleCache
from parallel3d.planning.search_progress import Report, SearchProgress


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    memory: MemoryEstimate
    step: StepEstimate
    simulated: bool  # False: ranked by the analytic pipeline estimate only

    @property
    def peak_bytes(self) -> float:
        return self.memory.peak_bytes


@dataclass
class Plan:
    config: ModelConfig
    cluster: ClusterSpec
    request: PlanRequest
    ranked: list[Candidate] = field(default_factory=list)  # best first, simulated ones
    considered: int = 0  # layouts enumerated
    fitting: int = 0  # of those, layouts with some recompute/ZeRO setting that fits
    simulated: int = 0  # settings timed by the full price (the rest were bounded out)
    # Where nothing fits: the setting with the smallest worst-rank peak of those estimated (None: none was).
    closest: tuple[Layout, MemoryEstimate] | None = None

    @property
    def best(self) -> Candidate:
        if not self.ranked:
            raise ValueError(f"no layout of {self.config.name or 'the model'} fits {self.cluster.gpus} x "
                             f"{self.cluster.device.name} at global_batch_size={self.request.global_batch_size} "
                             f"(planning.no_fit.nothing_fits says what is closest)")
        return self.ranked[0]


def _powers_of_two_upto(n: int) -> list[int]:
    out, x = [], 1
    while x <= n:
        out.append(x)
        x *= 2
    return out


def tensor_parallel_sizes(config: ModelConfig, gpus_per_node: int) -> list[int]:
    return [t for t in _powers_of_two_upto(gpus_per_node)
            if config.num_heads % t == 0 and config.kv_heads % t == 0 and config.ffn_size % t == 0]


def pipeline_sizes(num_layers: int, uneven: bool = False) -> list[int]:
    """Divisors of ``num_layers``; with ``uneven``, also depths whose stages differ by <= ~10%."""
    sizes = []
    for p in range(1, num_layers + 1):
        lo, hi = num_layers // p, -(-num_layers // p)
        if num_layers % p == 0 or (uneven and lo >= 1 and hi / (num_layers / p) <= 1.1):
            sizes.append(p)
    return sizes


def context_parallel_options(config: ModelConfig, cluster: ClusterSpec, request: PlanRequest,
                             tp: int) -> list[tuple[int, str, int | None]]:
    """(cp, cp_comm, cp_a2a_size) choices: cp = 1, and for each power-of-two cp up to
    ``request.max_cp`` every ``cp_comm`` variant (a2a+p2p with each proper a2a size)."""
    out: list[tuple[int, str, int | None]] = [(1, "p2p", None)]
    for c in _powers_of_two_upto(request.max_cp)[1:]:
        for comm in CP_COMM_VARIANTS:
            sizes = [a for a in _powers_of_two_upto(c)[1:-1]] if comm == "a2a+p2p" else [None]
            out += [(c, comm, a) for a in sizes]
    return out


def expert_parallel_sizes(config: ModelConfig, folded: int) -> list[int]:
    """ep degrees for an MoE model: divisors of the routed expert count that divide tp*cp*dp."""
    if not config.moe.enabled:
        return [1]
    return [e for e in range(1, config.moe.num_experts + 1) if config.moe.num_experts % e == 0 and folded % e == 0]


def expert_tp_choices(config: ModelConfig, tp: int, request: PlanRequest) -> list[int | None]:
    """etp values: the dense tp (None), and for an MoE model at tp > 1 also whole experts (etp = 1)."""
    if config.moe.enabled and tp > 1 and request.search_expert_options:
        return [None, 1]
    return [None]


def expert_zero_choices(config: ModelConfig, zero: int, request: PlanRequest) -> list[int | None]:
    """Expert ZeRO stages tried with dense stage ``zero``: the same (None), then, for MoE, the other
    searched stages (experts sharded further when the dense stage leaves them too large)."""
    if not config.moe.enabled or not request.search_expert_options:
        return [None]
    return [None, *(z for z in request.zero_stages if z > zero)]


def finest_virtual_stages(num_layers: int, pp: int, uneven: bool) -> int:
    """The most chunks per stage ``num_layers`` fill at ``pp`` stages: one layer per chunk (even splits:
    ``num_layers / pp`` when ``pp`` divides the layers, else 1); with uneven stages the first and the last
    chunk may hold the embedding or the head alone (``fewest_layers``), so up to ``(num_layers + 2) / pp``."""
    if uneven:
        return max(1, (num_layers + 2) // pp)
    return num_layers // pp if num_layers % pp == 0 else 1


def virtual_stage_counts(config: ModelConfig, pp: int, request: PlanRequest) -> list[int]:
    """Chunks per stage searched, the one rule the search, the published-layout completion and the rank
    check share (they differ only in the request's cap): 1 to ``max_virtual_stages``, and, when
    interleaving is searched at all (``max_virtual_stages`` > 1) and ``pp`` divides the layers, also one
    layer per chunk (``finest_virtual_stages``: v = layers / pp, Megatron's
    ``--num-layers-per-virtual-pipeline-stage 1``).

    Why: the finest even interleaving has the smallest bubble ((p - 1) / (v m)) a stage's layers
    allow, and Megatron runs it whatever the cap (a 56-layer model at pp 8 has 7 layers a stage: v = 7,
    where the cap allows only v <= 4, i.e. uneven chunks of 4 and 3 layers). Only this one value is added
    above the cap, which keeps the search's size: the values in between trade the same bubble against
    more P2P hops. A v the layers cannot fill is dropped later (``schedule_choices``).
    Invariant: ascending, no duplicates, each v >= 1."""
    cap = request.max_virtual_stages
    counts = list(range(1, cap + 1))
    finest = finest_virtual_stages(config.num_layers, pp, uneven=False)
    if cap > 1 and finest > cap:
        counts.append(finest)
    return counts


def schedule_choices(config: ModelConfig, pp: int, m: int, request: PlanRequest) -> list[tuple[str, int]]:
    """Every runtime schedule (``SCHEDULES``, minus GPipe: 1F1B's time with more memory) with the
    virtual-stage counts its options allow (``virtual_stage_counts``); chunks may hold unequal layer
    counts (uneven stages)."""
    out = []
    for name in SCHEDULES:
        if name not in request.schedules or (pp == 1 and name != "1f1b") or \
                (name == INTERLEAVED and pp < request.min_interleaved_pp):
            continue
        for v in virtual_stage_counts(config, pp, request):
            # Uneven stages include Llama 3 405B's split: the first and the last chunk may hold no layer
            # (pipeline.partition), so up to num_layers + 2 chunks fit.
            if (fewest_layers(pp * v) > config.num_layers if request.uneven_stages
                    else config.num_layers % (pp * v)):
                continue
            try:
                PipelineOptions(schedule=name, virtual_stages=v).check_layout(pp)
                PipelineOptions(schedule=name, virtual_stages=v).check_microbatches(pp, m)
            except ConfigError:
                continue
            out.append((name, v))
    return out


def enumerate_layouts(config: ModelConfig, cluster: ClusterSpec, request: PlanRequest) -> list[Layout]:
    """Every layout in the search space (module docstring), before any memory check."""
    layouts = []
    gbs = request.global_batch_size
    for tp in tensor_parallel_sizes(config, cluster.gpus_per_node):
        for cp, cp_comm, a2a in context_parallel_options(config, cluster, request, tp):
            if cp > 1 and request.seq_len % (2 * cp * tp):
                continue
            for pp in pipeline_sizes(config.num_layers, request.uneven_stages):
                if cluster.gpus % (tp * cp * pp):
                    continue
                dp = cluster.gpus // (tp * cp * pp)
                for ep, etp in ((e, x) for e in expert_parallel_sizes(config, tp * cp * dp)
                                for x in expert_tp_choices(config, tp, request)):
                    for mbs in request.micro_batch_sizes:
                        if gbs % (dp * mbs):
                            continue
                        m = gbs // (dp * mbs)
                        for schedule, v in schedule_choices(config, pp, m, request):
                            try:
                                layout = Layout(
                                    tp=tp, cp=cp, cp_comm=cp_comm, cp_a2a_size=a2a, ep=ep, etp=etp, pp=pp, dp=dp,
                                    sequence_parallel=request.sequence_parallel and tp > 1, schedule=schedule, virtual_stages=v,
                                    micro_batch_size=mbs, seq_len=request.seq_len, global_batch_size=gbs,
                                    precision=request.precision)
                                check_fits_model(config, layout)
                            except (ConfigError, LayoutError, ValueError):
                                continue
                            if all(getattr(layout, k) == v for k, v in request.fixed_degrees):
                                layouts.append(layout)
    return layouts


def memory_layout(layout: Layout) -> Layout:
    """``layout`` with fewer microbatches, for the memory estimate only: the fewest ``m' >= 3p`` with
    ``m' = m`` modulo ``2p`` (``m`` itself below ``5p``; GPipe, which holds every microbatch, never).

    A schedule's peak of in-flight activations is reached within its warm-up and first steady round
    (at most 2p microbatches for every runtime schedule, ZB-V's V included), or in its drain, which
    depends on where in its steady round the last microbatch falls: ZB-V's greedy order repeats every
    p (p 3, 4) or 2p (p 5) microbatches, and its W-pending peak with it (built in exact arithmetic; the
    engine's float build costs break some ties otherwise at large m: ``tests/test_planning_search.py``'s
    ``CAP_KNOWN_GAPS``) (llama 8 layers, h 1024, p 3:
    1,454,612,480 B at m = 0 mod 3, 1,387,061,248 B otherwise; p 4: m = 1 mod 4 peaks 2.6% above
    m = 0 mod 4). Keeping m's remainder modulo 2p keeps that drain, so building the schedule for at most
    5p microbatches instead of m gives the same peak (tests compare both) and keeps large searches fast.
    The step's microbatch tensors grow with m itself: the caller passes the step's count
    (``estimate_memory(step_microbatches=...)``).
    """
    p, m = layout.pp, layout.num_microbatches
    cap = 3 * p + (m - 3 * p) % (2 * p)
    if p == 1 or m <= cap or layout.schedule == "gpipe":
        return layout
    return layout.replace(global_batch_size=layout.dp * layout.micro_batch_size * cap)


def plan(config: ModelConfig, cluster: ClusterSpec, request: PlanRequest,
         options: CostOptions | None = None, progress: Report | None = None) -> Plan:
    """Rank the layouts of ``config`` on ``cluster`` by predicted step time (best first).

    ``ranked`` holds exactly the ``simulate_top`` fastest layouts by the full price (``estimate_step``,
    simulated schedule), fewer if fewer fit: every fitting setting is first bounded from below
    (``pipeline_lower_bound``), then simulated in the order of its bound until the next bound is above
    the ``simulate_top``-th best full price found, so a layout left unsimulated could not have entered.
    ``progress`` receives a line now and then on a long search (``search_progress``)."""
    options = options or CostOptions()
    ticker = SearchProgress(progress)
    if request.seq_len > config.max_seq_len:
        raise ValueError(f"train.seq_len={request.seq_len} exceeds model.max_seq_len={config.max_seq_len}")
    budget = cluster.device.memory_bytes * request.memory_fraction
    assumptions = job_assumptions(config, request.precision, request.document_mask)
    result = Plan(config=config, cluster=cluster, request=request)
    splits: dict[tuple[int, int], list[int]] = {}
    chunks: dict[tuple[int, int, str], list[list[int]]] = {}  # per (stage, chunk), by schedule placement
    bounded: list[tuple[float, int, Layout, MemoryEstimate]] = []  # (lower bound, base index, setting, memory)
    schedules = ScheduleCache()  # every (schedule, p, m, v) is built and validated once per search
    bases = enumerate_layouts(config, cluster, request)
    for index, base in enumerate(bases):
        ticker.layouts(index, len(bases), result.fitting)
        result.considered += 1
        key = (base.pp, base.virtual_stages)
        if key not in splits:
            splits[key] = stage_layer_counts(config, base.pp, base.virtual_stages, base.seq_len)
        ckey = (*key, base.schedule)
        if ckey not in chunks:
            chunks[ckey] = chunk_layer_counts(config, base, splits[key])
        fits_any = False
        for recompute in (r for r in RECOMPUTE_ORDER if r in request.recompute_modes):
            fits_on_device = False
            for zero in request.zero_stages:
                for offload, ezero in ((o, x) for o in request.offload_modes
                                       for x in expert_zero_choices(config, zero, request)):
                    if offload != "none" and zero == 0:
                        continue
                    layout = base.replace(recompute=recompute, zero_stage=zero, offload=offload,
                                          expert_zero_stage=ezero)
                    runs = options.runs(layout)
                    memory = estimate_memory(config, memory_layout(runs), assumptions, stage_layers=splits[key],
                                             schedules=schedules, step_microbatches=runs.num_microbatches)
                    if memory.peak_bytes > budget:
                        if result.closest is None or memory.peak_bytes < result.closest[1].peak_bytes:
                            result.closest = (layout, memory)
                        continue
                    fits_on_device |= offload == "none"
                    fits_any = True
                    # Every fitting setting is kept with its bound: the one the bound prefers for this
                    # base need not be the one the full price prefers.
                    bound = estimate_step(config, layout, cluster, options, splits[key],
                                          pipeline=pipeline_lower_bound, chunk_layers=chunks[ckey])
                    bounded.append((bound.step_time_s, index, layout, memory))
            if fits_on_device:
                break  # a cheaper recompute mode already fits: more recompute only costs time
        result.fitting += fits_any
    bounded.sort(key=lambda item: item[0])
    ticker.bounded(result.considered, len(bounded))
    best: dict[int, Candidate] = {}  # per base layout, its fastest simulated setting
    for bound, index, layout, memory in bounded:
        ticker.simulated(result.simulated, len(bounded))
        if len(best) >= request.simulate_top and bound > sorted(c.step.step_time_s for c in best.values())[
                request.simulate_top - 1]:
            break  # this bound, and every later one, is above the top's last full price
        key = (layout.pp, layout.virtual_stages)
        step = estimate_step(config, layout, cluster, options, splits[key],
                             chunk_layers=chunks[(*key, layout.schedule)], schedules=schedules)
        result.simulated += 1
        if index not in best or step.step_time_s < best[index].step.step_time_s:
            best[index] = Candidate(layout, memory, step, simulated=True)
    result.ranked = sorted(best.values(), key=lambda c: c.step.step_time_s)[: request.simulate_top]
    ticker.finished(result.simulated)
    return result


def job_assumptions(config: ModelConfig, precision: str, document_mask: bool,
                    kernels: str | None = None) -> ActivationAssumptions:
    """What the job's layers keep, with ``data.document_mask``'s per-microbatch tensors; ``kernels``: the activation
    profile (``plan.kernels``; None: ``ActivationAssumptions.for_model``'s, the fused kernels the search prices)."""
    profile = ActivationAssumptions.for_model(config, precision) if kernels is None \
        else ActivationAssumptions.for_model(config, precision, kernels)
    return replace(profile, document_ids=document_mask)


def evaluate(config: ModelConfig, layout: Layout, cluster: ClusterSpec,
             options: CostOptions | None = None, schedules: ScheduleCache | None = None,
             chunk_layers: list[list[int]] | None = None, document_mask: bool = False) -> Candidate:
    """Memory and simulated step time of one given layout (e.g. a published one); ``schedules``: the
    caller's built schedules where it evaluates several layouts (``ScheduleCache``); ``chunk_layers``: the
    layers of each (stage, local chunk) where the job splits them itself (``parallel.pp_layers``), else the
    engine's balanced split. ``document_mask``: the job's ``data.document_mask``."""
    splits = ([sum(c) for c in chunk_layers] if chunk_layers is not None
              else stage_layer_counts(config, layout.pp, layout.virtual_stages, layout.seq_len))
    options = options or CostOptions()
    schedules = ScheduleCache.of(schedules)
    memory = layout_memory(config, layout, options, schedules, splits, document_mask)
    step = estimate_step(config, layout, cluster, options, splits, chunk_layers=chunk_layers, schedules=schedules)
    return Candidate(layout, memory, step, simulated=True)


def layout_memory(config: ModelConfig, layout: Layout, options: CostOptions, schedules: ScheduleCache,
                  splits: list[int], document_mask: bool = False) -> MemoryEstimate:
    """``evaluate``'s memory estimate of ``layout`` with the engine's split ``splits`` (per-stage layers)."""
    runs = options.runs(layout)
    return estimate_memory(config, memory_layout(runs), job_assumptions(config, layout.precision, document_mask),
                           stage_layers=splits, schedules=schedules, step_microbatches=runs.num_microbatches)


def step_bound(config: ModelConfig, layout: Layout, cluster: ClusterSpec, options: CostOptions) -> float:
    """What ``evaluate(...).step.step_time_s`` of ``layout`` (the engine's split) can never go below: ``plan``'s
    pre-ranking bound (``pipeline_lower_bound``), for callers that keep only a layout faster than one they have."""
    splits = stage_layer_counts(config, layout.pp, layout.virtual_stages, layout.seq_len)
    return estimate_step(config, layout, cluster, options, splits, pipeline=pipeline_lower_bound).step_time_s


__all__ = ["Candidate", "Plan", "PlanRequest", "enumerate_layouts",
           "evaluate", "finest_virtual_stages", "job_assumptions", "layout_memory", "pipeline_sizes", "plan",
           "step_bound", "tensor_parallel_sizes",
           "virtual_stage_counts"]
