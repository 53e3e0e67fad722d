"""Predicted step time of a layout on a cluster.

Per microbatch and layer, on one tensor-parallel rank (``layer_time``):

- matmuls and attention scores: FLOPs / tp at ``peak`` times the efficiency of each GEMM's
  per-rank shape (``gemm``: thin shards and small hidden sizes run further from peak); a fused
  (flash) causal kernel computes only the unmasked blocks, about half the ``s x s`` product for long
  sequences (``gemm.causal_work_fraction``), unfused attention all of it;
- memory-bound elementwise work (norms, GeLU/SwiGLU, dropout, softmax): twice
  the bytes of the tensors the layer stores for backward (written once, read
  once) at HBM bandwidth; these are the Korthikanti terms of ``activations``;
- tensor-parallel collectives: two all-reduces (or all-gather + reduce-scatter
  with sequence parallel, the same volume) of the ``[b, s, h]`` activation in
  forward and two in backward (with Megatron-Core's ``--tp-comm-overlap`` only what ``tp_overlap``
  leaves exposed beside the GEMMs); full recompute repeats the forward ones;
- a fused attention kernel at the device's ``attention_efficiency`` (flat), its backward 2.5
  forwards (it recomputes the scores, ``gemm.FLASH_BACKWARD_FACTOR``);
- a fixed ``layer_overhead_s`` per layer forward (kernel launch gaps; twice per backward);
- backward = 2 x forward compute; full recompute adds one forward, selective
  recompute the attention scores (or, for torchtitan's per-op policy, every second matmul).

The pipeline is then *simulated* (``parallel3d.pipeline.schedules.simulate``)
with those per-chunk times (embedding on the first chunk, head and loss on the
last) and one P2P message per boundary. After a stage's last backward come its
data-parallel gradient reduction and parameter all-gather (dense parameters over dp x cp,
the rank's routed experts over the expert data-parallel group), minus what overlaps
with the backwards (each chunk's from its own last one, ``dp_overlap``; never the last gradient
bucket nor the first parameter bucket: ``CostOptions.grad_bucket``), a tied word embedding's gradient
summed over the first and last stage once both have reduced (unoverlapped; ``CostOptions.tied_grad_whole``),
and the Adam update (memory-bound). ZeRO-3 has no all-gather
after the step; it gathers the stage's parameters before every forward and
backward of every microbatch (``microbatch`` mode) or once per step (``step``),
prefetched behind compute, so only the DP traffic (its per-microbatch reduce-scatters
included) that exceeds the stage's compute time, plus the first layer's gather and
the last layer's reduce-scatter, is exposed. With ``offload`` the update runs on the host
at ``host_adam_elements_per_s`` while gradients go down and parameters come up the
host link (and, for ``disk``, the state is read and written at
``disk_bytes_per_s``); these overlap, so the slowest of them counts. The slowest
stage ends the step. Collectives are ring/hierarchical: inside a node at NVLink
bandwidth, across nodes at the NICs of the group's members on each node, plus NCCL's ring latency
per call for a group that spans nodes (``CommModel.ring_latency``); a DP reduction makes one call per
gradient bucket of the priced framework (``dp_bucket``, ``dp_calls``, ``bucketed_chunks``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from models.config import ModelConfig
from parallel3d.pipeline.partition import stage_layer_ranges
from parallel3d.pipeline.placement import placement_for
from parallel3d.planning.cluster import ClusterSpec
from parallel3d.planning.comm_cost import CommModel
from parallel3d.planning.cost_options import CostOptions
from parallel3d.planning.engine_split import engine_split
from parallel3d.planning.dp_overlap import chunk_shares, exposed_gather, exposed_reduction
from parallel3d.planning.gemm import GemmCurve, head_seconds
from parallel3d.planning.grad_buckets import bucket_count, unit_bucket_count
from parallel3d.planning.layer_time import COST_ATTENTION, LayerTimes, layer_forward_flops, layer_times
from parallel3d.planning.layout import Layout
from parallel3d.planning.memory import PrecisionBytes
from parallel3d.planning.params import rank_params, stage_expert_params, stage_layer_indices
from parallel3d.planning.pipeline_price import PipelineTimes, simulate_pipeline
from parallel3d.planning.schedule_cache import ScheduleCache
from parallel3d.planning.zb_lags import zb_h1_w_lags
from parallel3d.tensor_parallel.layers import padded_vocab_size

# Re-exported: callers and tests take the options and the per-layer time from here.
__all__ = ["COST_ATTENTION", "CostOptions", "LayerTimes", "StepEstimate", "chunk_layer_counts", "estimate_step",
           "head_forward_flops", "layer_forward_flops", "layer_times", "stage_grad_groups", "step_flops"]


@dataclass(frozen=True)
class StepEstimate:
    layout: Layout
    step_time_s: float
    pipeline_s: float  # simulated makespan of forward/backward
    dp_exposed_s: float  # gradient/parameter collectives not hidden (slowest stage)
    optimizer_s: float
    bubble_fraction: float
    model_flops: float  # per step, no recompute: 3 x forward (what MFU counts)
    hardware_flops: float  # per step, including recompute (what Megatron's TFLOP/s counts)
    gpus: int
    peak_flops: float
    # Step time of the stage that ends the step, by column: compute, exposed tp / cp / ep / pp (P2P)
    # communication, bubble (idle until its pipeline work ends), exposed dp and the optimizer.
    # The columns add up to ``step_time_s`` (bubble absorbs overlap the simulator found).
    breakdown: tuple[tuple[str, float], ...] = ()

    @property
    def tflops_per_gpu(self) -> float:
        """Achieved TFLOP/s per GPU counting recomputation, as Narayanan et al. report it."""
        return self.hardware_flops / self.step_time_s / self.gpus / 1e12

    @property
    def mfu(self) -> float:
        return self.model_flops / self.step_time_s / self.gpus / self.peak_flops

    def tokens_per_s(self) -> float:
        return self.layout.global_batch_size * self.layout.seq_len / self.step_time_s


def head_forward_flops(config: ModelConfig, micro_batch_size: int, seq_len: int, tp: int = 1) -> float:
    """The logits matmul of one microbatch over the vocabulary padded for ``tp`` (all tp ranks)."""
    return micro_batch_size * seq_len * config.shape.head_forward_flops(tp)


def step_flops(config: ModelConfig, layout: Layout) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs incl. recompute) of one whole step (all GPUs)."""
    flops = config.shape.flops_per_token(layout.seq_len, attention=COST_ATTENTION, recompute=layout.recompute)
    tokens = layout.global_batch_size * layout.seq_len
    return flops.model * tokens, flops.hardware * tokens


def _end_times(layout: Layout, cluster: ClusterSpec, comm: CommModel,
               config: ModelConfig) -> tuple[float, float, float, float]:
    """(embedding fwd, embedding bwd, head fwd, head bwd) extra time on the first / last chunk."""
    dev, t = cluster.device, layout.tp
    e = 4 if layout.precision == "fp32" else 2
    tokens = layout.micro_batch_size * layout.seq_len / layout.cp  # a cp rank embeds and scores its share
    act_bytes = e * tokens * config.hidden_size
    emb_fwd = comm.all_reduce(act_bytes, "tp")  # vocab-parallel lookup: partial rows summed over tp
    head_mm = head_forward_flops(config, layout.micro_batch_size, layout.seq_len, t) / t / layout.cp
    vocab = padded_vocab_size(config.vocab_size, t) // t
    logits = 4.0 * tokens * vocab
    head_fwd = head_seconds(GemmCurve.of(dev), head_mm, tokens=tokens,
                            vocab_per_rank=vocab, hidden=config.hidden_size) + 2 * logits / dev.hbm_bytes_per_s
    head_bwd = 2 * head_fwd + comm.all_reduce(act_bytes, "tp")  # grad of the head's replicated input
    return emb_fwd, 0.0, head_fwd, head_bwd


def _zero3_exposed(layout: Layout, reduce_all: float, gather_all: float, busy: float,
                   layers: int) -> tuple[float, float]:
    """ZeRO-3's (reduce-scatter, all-gather) time not hidden behind the stage's compute (module doc).

    Per step the DP link carries one reduce-scatter of the stage's gradients per microbatch and one
    all-gather of its weights per pass (2 per microbatch, or 1 per step); they overlap compute but
    share the link, so what exceeds the compute time is exposed, plus the first unit's gather and
    the last unit's reduce-scatter, which have nothing to hide behind."""
    passes = 2 * layout.num_microbatches if layout.zero3_mode == "microbatch" else 1
    units = max(1, layers)
    traffic = layout.num_microbatches * reduce_all + passes * gather_all
    over = max(0.0, traffic - busy)
    share = reduce_all * layout.num_microbatches / traffic if traffic else 0.0
    return over * share + reduce_all / units, over * (1 - share) + gather_all / units


def stage_grad_groups(config: ModelConfig, layout: Layout, stage: int, layers: int) -> list[tuple[float, str, int]]:
    """(parameters on one rank, the group their gradients reduce over, ZeRO stage) of a stage: the
    dense ones over ``dp_cp`` at ``zero_stage``, the routed experts this rank holds (``experts / ep``,
    ``1 / etp`` of each) over ``edp`` at the expert ZeRO stage, as the runtime and the estimator
    shard them. (``rank_params`` counts every expert whole: reducing that over dp priced an ep=8
    layout's expert gradients 8x too large and over the wrong group.)"""
    ids = stage_layer_indices(config, layout.pp, stage, layers, layout.seq_len)
    held = rank_params(config, layout.tp, layout.pp, stage, ids, layout.placement)
    whole, expert = stage_expert_params(config, layout.pp, stage, ids, layout.ep, layout.etp or layout.tp)
    groups = [(float(held.total - whole), "dp_cp", layout.zero_stage)]
    if expert:
        groups.append((float(expert), "edp", layout.expert_zero))
    return groups


def _dp_times(comm: CommModel, params: float, kind: str, zero: int, grad_bytes: int,
              weight_bytes: int, calls: int = 1) -> tuple[float, float]:
    """(gradient reduction, parameter all-gather) of ``params`` over the ``kind`` group, in ``calls``
    collective calls each way."""
    if zero == 0:
        return comm.all_reduce(params * grad_bytes, kind, calls), 0.0
    return (comm.reduce_scatter(params * grad_bytes, kind, calls),
            comm.all_gather(params * weight_bytes, kind, calls))


def dp_bucket(options: CostOptions, dp: int) -> float | None:
    """Parameters per gradient bucket in the priced framework (``CostOptions.grad_bucket``), None for
    parallel3d's own. Megatron-Core scales it by the data-parallel size without cp and uses it for the
    expert buffers too (core_r0.8.0-r0.11.0 ``DistributedDataParallel``: ``get_data_parallel_world_size()``)."""
    if options.grad_bucket is None:
        return None
    low, per_rank = options.grad_bucket
    return max(low, per_rank * dp)


def dp_calls(bucket: float | None, params: float, zero: int, layers: int, weight_bytes: int,
             bucketed: float = 1.0, whole_chunks: int = 0, *, unit_calls: bool = False) -> int:
    """Collective calls one DP reduction (or gather) of a stage's ``params`` takes: ZeRO-3 one per layer
    (each a gather unit) with ``unit_calls`` (``CostOptions.zero3_unit_calls``), else parallel3d's buckets within
    each unit (``unit_bucket_count``); stages 0-2 one per gradient bucket (``dp_bucket``; parallel3d's own
    ``bucket_count`` when None) of the ``bucketed`` share of the parameters, plus one per chunk left in a single
    bucket (``whole_chunks``: ``CostOptions.bucket_first_chunk_only``)."""
    if zero == 3:
        return max(1, layers) if unit_calls else unit_bucket_count(params, layers, weight_bytes)
    if bucket is None:
        return bucket_count(params, weight_bytes)
    return whole_chunks + (max(1, math.ceil(params * bucketed / bucket)) if bucketed > 0 else 0)


def bucketed_chunks(options: CostOptions, stage: int, share: list[float]) -> tuple[float, int]:
    """(share of a stage's parameters cut into buckets, chunks left whole, one call each), given each chunk's
    share: all of them bucketed, or with ``CostOptions.bucket_first_chunk_only`` only stage 0's first chunk."""
    if not options.bucket_first_chunk_only:
        return 1.0, 0
    return (share[0], len(share) - 1) if stage == 0 else (0.0, len(share))


def _tied_grad_time(config: ModelConfig, layout: Layout, comm: CommModel, options: CostOptions, two_ends: bool,
                    words: float, grad_bytes: int) -> float:
    """The tied word embedding's gradient sum over its first and last stage (``words`` elements per tp rank):
    the whole gradient, or with parallel3d's ZeRO only this rank's DP-reduced piece
    (``CostOptions.tied_grad_whole``). None where one stage holds both ends (pp = 1, ZB-V) or untied."""
    if not (config.tie_embeddings and two_ends):
        return 0.0
    if not options.tied_grad_whole and layout.zero_stage >= 1:
        words /= comm.group_size("dp_cp")
    return comm.all_reduce(words * grad_bytes, "embedding")


def _optimizer_time(layout: Layout, device, pb: PrecisionBytes, shard: float, grad_bytes: int) -> float:
    """The Adam update of ``shard`` elements: memory-bound on the device, or on the host with offload."""
    if layout.offload == "none":
        # Adam reads the gradient, master weight and moments, writes them back and the model weight.
        master = pb.master or pb.weight
        return shard * (pb.grad + 2 * (master + pb.moments) + pb.weight) / device.hbm_bytes_per_s
    host = shard / device.host_adam_elements_per_s
    link = shard * (grad_bytes + pb.weight) / device.host_link_bytes_per_s  # gradients down, parameters up
    disk = 2 * 12 * shard / device.disk_bytes_per_s if layout.offload == "disk" else 0.0  # read + write state
    return max(host, link, disk)


def chunk_layer_counts(config: ModelConfig, layout: Layout,
                       stage_layers: list[int] | None = None) -> list[list[int]]:
    """Layers of each (stage, local chunk), split and placed as the pipeline engine does
    (``partition_layers``, the schedule's placement): with uneven stages a chunk may hold more
    layers than its neighbours, and the first / last model chunk may hold none (embedding or head
    alone). Given ``stage_layers`` that this split does not produce (a caller's own), each stage's
    layers are spread evenly over its chunks."""
    p, v = layout.pp, layout.virtual_stages
    placement = placement_for(layout.schedule, p, v)  # v: chunks per stage
    ranges = engine_split(config, p, v, layout.seq_len)
    per = [[b - a for a, b in stage_layer_ranges(ranges, p, s, placement)] for s in range(p)]
    if stage_layers is not None and [sum(c) for c in per] != list(stage_layers):
        return [[n / v] * v for n in stage_layers]
    return per


def estimate_step(config: ModelConfig, layout: Layout, cluster: ClusterSpec,
                  options: CostOptions | None = None, stage_layers: list[int] | None = None,
                  pipeline: Callable[..., PipelineTimes] | None = None,
                  chunk_layers: list[list[int]] | None = None,
                  schedules: ScheduleCache | None = None) -> StepEstimate:
    """Predicted time of one optimizer step of ``layout`` (see the module docstring).

    ``pipeline`` times the schedule: ``simulate_pipeline`` (default) or a cheaper
    stand-in with the same signature (the planner's pre-ranking: ``pipeline_lower_bound``). Each chunk is priced by
    its own layers (``chunk_layers``, default ``chunk_layer_counts``) plus the embedding on the
    first model chunk and the head on the last. ``schedules``: the search's built schedules (``ScheduleCache``).
    """
    options = options or CostOptions()
    if layout.world_size != cluster.gpus:
        raise ValueError(f"layout uses tp*pp*dp={layout.world_size} GPUs but cluster.gpus={cluster.gpus}")
    if layout.tp > cluster.gpus_per_node:
        raise ValueError(f"parallel.tp={layout.tp} exceeds cluster.gpus_per_node={cluster.gpus_per_node}")
    p, v = layout.pp, layout.virtual_stages
    if chunk_layers is None:
        chunk_layers = chunk_layer_counts(config, layout, stage_layers)
    if stage_layers is None:
        stage_layers = [round(sum(c)) for c in chunk_layers]
    topo = layout.topology
    comm = CommModel(cluster, topo)
    lt = layer_times(config, layout, cluster, comm, options)
    emb_f, emb_b, head_f, head_b = _end_times(layout, cluster, comm, config)

    placement = placement_for(layout.schedule, p, p * v)
    first, last = placement.stage_and_chunk(0), placement.stage_and_chunk(p * v - 1)

    def ends(stage: int, chunk: int, emb: float, head: float) -> float:
        # One chunk can be both ends (pp = 1 and v = 1): it runs the embedding *and* the head and loss.
        return (emb if (stage, chunk) == first else 0.0) + (head if (stage, chunk) == last else 0.0)

    def fwd(stage: int, chunk: int) -> float:
        return chunk_layers[stage][chunk] * lt.fwd + ends(stage, chunk, emb_f, head_f)

    def bwd(stage: int, chunk: int) -> float:
        return chunk_layers[stage][chunk] * lt.bwd + ends(stage, chunk, emb_b, head_b)

    e = 4 if layout.precision == "fp32" else 2
    msg = e * layout.micro_batch_size * layout.seq_len / layout.cp * config.hidden_size  # this cp rank's tokens
    if layout.sequence_parallel or options.p2p_scatter_gather:
        msg /= layout.tp
    p2p = comm.p2p(msg)
    if options.p2p_scatter_gather and not layout.sequence_parallel and p > 1:
        p2p += comm.all_gather(msg * layout.tp, "tp")
    drain = options.runs(layout).splits_drain  # the implementation's 1F1B (cost_options)
    if pipeline is None:  # zb_h1 as the runtime builds it: the lags its bytes allow (zb_lags)
        lags = zb_h1_w_lags(config, layout) if layout.schedule == "zb_h1" else None
        pipe = simulate_pipeline(layout.schedule, p, layout.num_microbatches, v, fwd, bwd, p2p, w_lags=lags,
                                 split_drain=drain, schedules=schedules)
    else:
        pipe = pipeline(layout.schedule, p, layout.num_microbatches, v, fwd, bwd, p2p, split_drain=drain)

    pb = PrecisionBytes.for_precision(layout.precision)
    grad_bytes = options.dp_grad_bytes or pb.grad
    finish, dp_worst, opt_worst, crit = 0.0, 0.0, 0.0, 0
    reduced: list[float] = []  # each stage's end of its gradient reductions
    after: list[tuple[float, float]] = []  # each stage's exposed parameter all-gather and optimizer update
    emb_params = padded_vocab_size(config.vocab_size, layout.tp) // layout.tp * config.hidden_size
    bucket = dp_bucket(options, layout.dp)
    for stage in range(p):
        reduce_t = gather_t = hideable_r = hideable_g = opt_t = last_r = first_g = 0.0
        end_counts = [((stage, c) == first) + ((stage, c) == last) for c in range(v)]
        groups = stage_grad_groups(config, layout, stage, stage_layers[stage])
        held = sum(params for params, _, _ in groups)
        share = chunk_shares(chunk_layers[stage], end_counts, held, emb_params)
        bucketed, whole = bucketed_chunks(options, stage, share)
        for params, kind, zero in groups:
            calls = dp_calls(bucket, params, zero, stage_layers[stage], pb.weight, bucketed, whole,
                             unit_calls=options.zero3_unit_calls)
            r, g = _dp_times(comm, params, kind, zero, grad_bytes, pb.weight, calls)
            br = bg = 0.0
            if bucket is not None and zero != 3:  # a parameter is never split over two buckets
                emb = emb_params if (stage, kind) == (0, "dp_cp") else 0.0
                br, bg = _dp_times(comm, min(params, max(bucket, emb)), kind, zero, grad_bytes, pb.weight)
            if zero == 3:
                r, g = _zero3_exposed(layout, r, g, pipe.busy[stage], stage_layers[stage])
                reduce_t, gather_t = reduce_t + r, gather_t + g
            else:
                overlapped = zero in options.overlapped_zero_stages
                reduce_t, hideable_r = reduce_t + (0.0 if overlapped else r), hideable_r + (r if overlapped else 0.0)
                gathered = options.overlap_param_gather and zero in (1, 2)
                gather_t, hideable_g = gather_t + (0.0 if gathered else g), hideable_g + (g if gathered else 0.0)
                last_r, first_g = last_r + (br if overlapped else 0.0), first_g + (bg if gathered else 0.0)
            shard = params / comm.group_size(kind) if zero >= 1 else params
            opt_t += _optimizer_time(layout, cluster.device, pb, shard, grad_bytes)
        # The dense and expert reductions share the NICs, so they add; the overlapped ones hide behind
        # the last microbatch's backward, the parameter all-gathers behind the next step's first forward.
        if options.chunk_grad_sync and pipe.bound:
            # A lower bound of the rule below (the planner's pre-ranking): a rank's link carries the whole
            # traffic from the step's start at the earliest, and only the floors are always exposed.
            reduce_t += max(last_r, hideable_r - pipe.stage_end[stage])
            gather_t += first_g
        elif options.chunk_grad_sync and pipe.chunk_grads_done:  # each chunk overlaps from its own pass (dp_overlap)
            reduce_t += exposed_reduction([hideable_r * w for w in share], pipe.chunk_grads_done[stage],
                                          [bwd(stage, c) for c in range(v)], pipe.stage_end[stage], last_r)
            gather_t += exposed_gather([hideable_g * w for w in share], pipe.chunk_first_forward[stage],
                                       [fwd(stage, c) for c in range(v)], first_g)
        else:  # one pass of one chunk hides it (a bound's stage ends bound this too: it only grows with them)
            reduce_t += max(last_r, hideable_r - bwd(stage, 0))
            gather_t += max(first_g, hideable_g - fwd(stage, 0))
        reduced.append(pipe.stage_end[stage] + reduce_t)
        after.append((gather_t, opt_t))
    tied = _tied_grad_time(config, layout, comm, options, first[0] != last[0], emb_params, grad_bytes)
    if tied:  # the two ends meet after their own reductions, then sum (before the optimizer, as Megatron-LM)
        reduced[first[0]] = reduced[last[0]] = max(reduced[first[0]], reduced[last[0]]) + tied
    for stage, (gather_t, opt_t) in enumerate(after):
        end = reduced[stage] + gather_t + opt_t
        if end >= finish:  # dp: everything after the pipeline but the optimizer (the tied sum's wait included)
            finish, dp_worst, opt_worst = end, reduced[stage] - pipe.stage_end[stage] + gather_t, opt_t
            crit = stage
    model_flops, hardware_flops = step_flops(config, layout)
    # The finishing stage's time split into columns that add up to the step (module docstring of
    # ``StepEstimate.breakdown``): its per-layer communication x layers x microbatches, the rest of its busy
    # time is compute; what its pipeline end leaves over is idle: its P2P messages (which the simulator
    # charges to the receiver's wait, not to the busy time: ``fwd`` / ``bwd`` hold no P2P), up to that idle,
    # and the rest is bubble. (Taking P2P off the busy time instead made compute shrink as the network
    # slowed, and the columns overrun the step where P2P outweighed a tiny stage's compute.)
    m = layout.num_microbatches
    parts = {k: t * stage_layers[crit] * m for k, t in lt.comm}
    busy = sum(fwd(crit, ch) + bwd(crit, ch) for ch in range(v)) * m
    idle = max(0.0, pipe.stage_end[crit] - busy)
    parts = {"compute": max(0.0, busy - sum(parts.values())), **parts}
    parts["pp"] = min(2 * m * v * p2p, idle) if p > 1 else 0.0
    parts["bubble"] = idle - parts["pp"]
    parts["dp"], parts["optimizer"] = dp_worst, opt_worst
    return StepEstimate(
        layout=layout, step_time_s=finish, pipeline_s=pipe.makespan, dp_exposed_s=dp_worst,
        optimizer_s=opt_worst, bubble_fraction=pipe.bubble_fraction, model_flops=model_flops,
        hardware_flops=hardware_flops, gpus=cluster.gpus, peak_flops=cluster.device.peak_flops,
        breakdown=tuple(parts.items()),
    )
