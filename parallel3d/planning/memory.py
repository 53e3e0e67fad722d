"""Per-rank memory of a layout, by category; the worst rank decides whether it fits.

Model states (weights, gradients, master weights, moments; offloaded state) follow the ZeRO paper's
arithmetic in ``planning.model_states``; ZeRO-3's gather window is ``planning.gather_window``. Activations
come from ``parallel3d.planning.activations`` times the microbatches each stage holds in flight under the
schedule. Every rank of a pipeline stage holds the same amount (the vocabulary is padded so tp shards are
equal), so the estimate is computed per stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from models.config import ModelConfig
from parallel3d.planning.activations import (
    ActivationAssumptions,
    chunk_in_flight_moments,
    chunk_output_bytes,
    embedding_activation_bytes,
    head_activation_bytes,
    inflight_chunks,
    kept_chunk_outputs,
    layer_activation_bytes,
    mlp_half_activation_bytes,
    received_input_bytes,
)
from parallel3d.planning.batch_tensors import step_batch_bytes
from parallel3d.planning.gather_window import gather_window_params
from parallel3d.planning.grad_buckets import largest_grad_piece, reduce_scatter_staging_bytes
from parallel3d.planning.layout import Layout, check_fits_model
from parallel3d.planning.model_states import PrecisionBytes, model_state_bytes, offloaded_state_bytes
from parallel3d.planning.params import (
    largest_tensor,
    rank_params,
    stage_expert_params,
    stage_layer_counts,
    stage_layer_ids,
)
from parallel3d.pipeline.partition import stage_layer_ranges
from parallel3d.planning.engine_split import engine_split
from parallel3d.planning.position_bytes import rotary_chunk_bytes
from parallel3d.planning.schedule_cache import ScheduleCache
from parallel3d.planning.sequence_experts import cp_inflight_kv_bytes, local_seq_len, moe_combine_backward_bytes
from parallel3d.planning.split_memory import split_peak_bytes, stage_computations
from parallel3d.planning.zb_lags import zb_h1_w_lags
from parallel3d.tensor_parallel.layers import padded_vocab_size
from parallel3d.zero.adamw_multi import step_temporaries
from parallel3d.zero.clip import SQ_SUM_TEMPORARY_BYTES

CATEGORIES: tuple[str, ...] = ("weights", "gradients", "master_weights", "optimizer_moments", "activations",
                               "workspace")


@dataclass(frozen=True)
class StageMemory:
    """Bytes on one rank of pipeline ``stage``."""

    stage: int
    params: int  # parameters this rank holds (its tp shard of its layers + embedding/head)
    inflight: int  # (microbatch, chunk) activations held at the peak
    weights: float
    gradients: float
    master_weights: float
    optimizer_moments: float
    activations: float
    workspace: float = 0.0  # transients of one layer / the loss (cp K/V in flight, logits' gradients)
    host: float = 0.0  # offloaded optimizer state in host memory (not device memory)
    disk: float = 0.0  # offloaded optimizer state on disk
    # Of ``weights`` / ``gradients``, what is not the optimizer's flat buffers: ZeRO-3's gather window, and the
    # one gradient a hook is moving into its main-grad buffer or shard (``model_state_bytes``).
    gathered_weights: float = 0.0
    gradient_in_flight: float = 0.0

    @property
    def total(self) -> float:
        """Device bytes (offloaded state excluded)."""
        return sum(getattr(self, c) for c in CATEGORIES)

    def by_category(self) -> dict[str, float]:
        return {c: getattr(self, c) for c in CATEGORIES}


@dataclass(frozen=True)
class MemoryEstimate:
    config: ModelConfig
    layout: Layout
    stages: list[StageMemory] = field(default_factory=list)

    @property
    def worst(self) -> StageMemory:
        return max(self.stages, key=lambda m: m.total)

    @property
    def peak_bytes(self) -> float:
        return self.worst.total

    def fits(self, device_bytes: float) -> bool:
        return self.peak_bytes <= device_bytes


def stage_layer_indices(config: ModelConfig, layout: Layout, stage_layers: Sequence[int]) -> list[list[int]]:
    """Global layer indices of every stage for per-stage counts ``stage_layers``: the pipeline engine's
    own split where the counts are its counts, else consecutive runs of the counts (the stage order
    of a single-chunk pipeline; with virtual stages, an approximation for custom counts)."""
    engine = engine_split(config, layout.pp, layout.virtual_stages, layout.seq_len)
    by_stage = [[i for a, b in stage_layer_ranges(engine, layout.pp, s) for i in range(a, b)]
                for s in range(layout.pp)]
    if [len(ids) for ids in by_stage] == list(stage_layers):
        return by_stage
    starts = [sum(stage_layers[:s]) for s in range(layout.pp)]
    return [list(range(start, start + n)) for start, n in zip(starts, stage_layers)]


def stage_activation_bytes(
    config: ModelConfig, layout: Layout, stage: int, layers: int | Sequence[int], assumptions: ActivationAssumptions,
    chunk_layers: Sequence[Sequence[int]] | None = None, w_lags: Sequence[int] | None = None,
    schedules: ScheduleCache | None = None, step_microbatches: int | None = None,
) -> tuple[float, int]:
    """(peak activation bytes, in-flight chunk count) on one rank of ``stage`` holding ``layers`` (a
    count, where every layer has the same block, or the global indices: each layer's own block).

    The first stage also holds the embedding's activations for every in-flight microbatch; the last stage the
    head's for the one whose backward it runs (GPipe: all of them). Each chunk with layers, its rotary tables.

    Each in-flight chunk is counted as holding the mean of the stage's chunks (``1/v`` of its layers):
    exact where the chunks are alike. ``chunk_layers`` (the global layer indices of each of the stage's
    local chunks, in order, e.g. from ``parallel.pp_layers``) makes it exact where they differ (Llama 3
    405B's embedding-only first and head-only last chunk; uneven stages): the peak is then the largest
    sum, over the schedule's most-loaded moments (``chunk_in_flight_moments``), of each chunk's
    microbatches in flight times its own bytes. That builds the schedule (seconds at m = 128), so the
    planner's search, which passes counts, keeps the mean. ``w_lags``: zb_h1's lags of every stage when the
    caller has them (``zb_h1_w_lags`` prices all stages at once: once per layout, not once per stage).
    ``schedules``: the search's built schedules (``ScheduleCache``), where a schedule is built. Plus, with
    ``small_stats``, the step's microbatch tensors, once, for ``step_microbatches`` of them (default: the layout's;
    the search's ``memory_layout`` caps the layout's count, not the step's).
    """
    peak, inflight = _in_flight_peak(config, layout, stage, layers, assumptions, chunk_layers, w_lags, schedules)
    return peak + (step_batch_bytes(layout, stage, assumptions.batch_on_host, step_microbatches,
                                    assumptions.document_ids) if assumptions.small_stats else 0), inflight


def _in_flight_peak(config: ModelConfig, layout: Layout, stage: int, layers: int | Sequence[int],
                    assumptions: ActivationAssumptions, chunk_layers: Sequence[Sequence[int]] | None,
                    w_lags: Sequence[int] | None, schedules: ScheduleCache | None) -> tuple[float, int]:
    """``stage_activation_bytes`` but for the step's microbatch tensors: what the in-flight microbatches hold."""
    ids = stage_layer_ids(config.shape, layers)
    computations = stage_computations(config, layout, stage, w_lags, schedules)
    if computations is not None:  # B and W split: held and W-pending bytes per chunk (split_memory)
        v = layout.virtual_stages
        chunks = chunk_layers if chunk_layers is not None and len(chunk_layers) == v \
            else [ids[c * len(ids) // v:(c + 1) * len(ids) // v] for c in range(v)]
        return split_peak_bytes(config, layout, stage, computations, chunks, assumptions,
                                lambda c: _layers_bytes(config, layout, c, assumptions)
                                + _tables(config, layout, c, assumptions), schedules)
    loop = layout.placement.chunks_of(layout.pp - 1)[-1] \
        == layout.pp * layout.virtual_stages - 1  # the head on the last stage's last chunk (not zbv's V)
    if chunk_layers is not None and layout.virtual_stages > 1 and len(chunk_layers) == layout.virtual_stages \
            and loop:
        per_chunk = [_layers_bytes(config, layout, ids, assumptions) + _tables(config, layout, ids, assumptions)
                     + (received_input_bytes(config, layout, assumptions, bool(ids)) if stage or c else 0.0)
                     for c, ids in enumerate(chunk_layers)]
        if stage == 0:
            per_chunk[0] += embedding_activation_bytes(config, layout, assumptions)
        if stage == layout.pp - 1:  # the model's last chunk: the head's, while its microbatch is in flight
            per_chunk[-1] += head_activation_bytes(config, layout, assumptions)
        if len(set(per_chunk)) > 1:
            moments = chunk_in_flight_moments(layout.schedule, layout.pp, layout.num_microbatches,
                                              layout.virtual_stages, stage, layout.splits_drain, schedules)
            total = max(sum(n * b for n, b in zip(live, per_chunk)) for live in moments)
            inflight = max(sum(live) for live in moments)
            outputs = kept_chunk_outputs(layout, stage, inflight, assumptions)
            return total + outputs * chunk_output_bytes(config, layout, assumptions), inflight
    inflight = inflight_chunks(layout, stage, schedules)
    # a chunk in flight holds 1/v of the stage's layers: their mean bytes per chunk
    total = inflight * (_layers_bytes(config, layout, ids, assumptions) / layout.virtual_stages
                        + _tables(config, layout, ids, assumptions))
    microbatches_in_flight = math.ceil(inflight / layout.virtual_stages)
    # every chunk but the model's first receives its input (on stage 0: all but chunk 0's microbatches)
    received = inflight - (microbatches_in_flight if stage == 0 else 0)
    total += received * received_input_bytes(config, layout, assumptions, bool(ids))
    if stage == 0:
        total += microbatches_in_flight * embedding_activation_bytes(config, layout, assumptions)
    return total + _outputs_and_head(config, layout, stage, inflight, assumptions), inflight


def _layers_bytes(config: ModelConfig, layout: Layout, ids: Sequence[int], assumptions: ActivationAssumptions) -> float:
    """Kept bytes of layers ``ids`` for one microbatch (each distinct block computed once: the planner
    calls this for every layout it searches)."""
    by_block: dict = {}
    for i in ids:
        first, count = by_block.get(config.spec.blocks[i], (i, 0))
        by_block[config.spec.blocks[i]] = (first, count + 1)
    return sum(n * layer_activation_bytes(config, layout, assumptions, i) for i, n in by_block.values())


def _tables(config: ModelConfig, layout: Layout, ids: Sequence[int], assumptions: ActivationAssumptions) -> float:
    """One microbatch's rotary tables the layers ``ids`` of one chunk save, once for all (``position_bytes``)."""
    return rotary_chunk_bytes(config, layout, assumptions.element_bytes, assumptions.rope_cast_copies,
                              assumptions.document_ids) if ids else 0.0


def _outputs_and_head(config: ModelConfig, layout: Layout, stage: int, inflight: int,
                      assumptions: ActivationAssumptions) -> float:
    """Kept chunk outputs at the peak, and on the last stage the head's kept tensors (schedules whose
    backwards are not split: those that are, ``split_memory``)."""
    total = kept_chunk_outputs(layout, stage, inflight, assumptions) * chunk_output_bytes(config, layout, assumptions)
    if stage == layout.pp - 1:
        held = layout.num_microbatches if layout.schedule == "gpipe" else 1
        total += held * head_activation_bytes(config, layout, assumptions)
    return total


def estimate_memory(
    config: ModelConfig,
    layout: Layout,
    assumptions: ActivationAssumptions | None = None,
    stage_layers: list[int] | None = None,
    schedules: ScheduleCache | None = None,
    step_microbatches: int | None = None,
) -> MemoryEstimate:
    """Per-stage memory of ``layout`` running ``config``; ``.worst`` is the rank that decides.

    ``stage_layers`` (layers per stage) defaults to the pipeline engine's split;
    callers that evaluate many layouts pass it to avoid recomputing the split, and ``schedules`` (theirs).
    ``step_microbatches``: the step's count where ``layout``'s is capped (``stage_activation_bytes``).
    """
    check_fits_model(config, layout)
    if assumptions is None:
        assumptions = ActivationAssumptions.for_model(config, layout.precision)
    if stage_layers is None:
        stage_layers = stage_layer_counts(config, layout.pp, layout.virtual_stages, layout.seq_len)
    if len(stage_layers) != layout.pp or sum(stage_layers) != config.num_layers:
        raise ValueError(f"stage_layers={stage_layers} must give pp={layout.pp} counts summing to "
                         f"model.num_layers={config.num_layers}")
    ids = stage_layer_indices(config, layout, stage_layers)
    lags = zb_h1_w_lags(config, layout) if layout.schedule == "zb_h1" else None
    schedules = ScheduleCache.of(schedules)  # zbv: one build for all stages
    stages = [_stage_memory(config, layout, stage, ids[stage], assumptions, lags, schedules, step_microbatches)
              for stage in range(layout.pp)]
    return MemoryEstimate(config=config, layout=layout, stages=stages)


def _add(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: a[k] + b[k] for k in a}


def workspace_bytes(config: ModelConfig, layout: Layout, stage: int, assumptions: ActivationAssumptions,
                    layers: Sequence[int] | None = None) -> float:
    """Transient bytes at the step's peak beyond the kept activations.

    Three moments can set the peak: the loss's backward on the loss's stage (logit-sized gradients, all
    activations still kept); where the stage's last layer is MoE, its combine's backward (the first of
    the stage's layer backwards, ``moe_combine_backward_bytes``), by which time the last stage has
    freed the head's kept tensors; and the first attention backward with cp (one layer's K/V buffers in
    flight, ``cp_inflight_kv_bytes``), by which time backward has also freed that layer's MLP half.
    The largest net excess over the kept activations counts.
    ``layers``: the stage's global layer indices (its last layer's backward comes first); needed
    where the layers differ.
    """
    last = layout.placement.stage_of(layout.num_chunks - 1) == stage  # the loss's stage (zbv's V: stage 0)
    loss = 0.0
    if last:
        logits = local_seq_len(layout) * layout.micro_batch_size * padded_vocab_size(config.vocab_size, layout.tp)
        loss = assumptions.logits_backward_copies * assumptions.logits_bytes * logits / layout.tp
    first_backward = layers[-1] if layers else None
    if layers is not None and not layers:  # a stage without layers runs no attention
        return max(loss, 0.0)
    head = head_activation_bytes(config, layout, assumptions) if last else 0.0
    block = config.spec.blocks[first_backward if first_backward is not None else -1]
    combine = moe_combine_backward_bytes(block, layout, assumptions.element_bytes) - head if block.moe else 0.0
    freed = mlp_half_activation_bytes(config, layout, assumptions, first_backward) + head
    attention = cp_inflight_kv_bytes(config, layout, assumptions.element_bytes,
                                     reference_kernels=assumptions.reference_attention_blocks,
                                     gather_staging_copies=assumptions.gather_staging_copies) - freed
    return max(loss, combine, attention, 0.0)


def _stage_memory(config: ModelConfig, layout: Layout, stage: int, layers: Sequence[int],
                  assumptions: ActivationAssumptions, w_lags: Sequence[int] | None = None,
                  schedules: ScheduleCache | None = None, step_microbatches: int | None = None) -> StageMemory:
    """One rank of ``stage``: dense states sharded by ZeRO over dp x cp (``dp_cp``), routed experts'
    states over ``edp = tp*cp*dp / (ep*etp)`` at ``layout.expert_zero``, plus activations and workspace."""
    held = rank_params(config, layout.tp, layout.pp, stage, layers, layout.placement).total
    etp = layout.etp or layout.tp
    expert_whole, expert_held = stage_expert_params(config, layout.pp, stage, layers, layout.ep, etp)
    dense = held - expert_whole  # rank_params counts every expert whole on every rank
    largest = largest_tensor(config, layout.tp, layout.pp, stage, layers, layout.placement)
    dp_cp = layout.dp * layout.cp
    edp = layout.tp * layout.cp * layout.dp // (layout.ep * etp)

    def states_of(params: int, group: int, zero: int, largest_param: int = 0, gathered: int = 0) -> dict[str, float]:
        return model_state_bytes(params, group, zero, layout.precision, layout.grad_reduce_dtype, largest_param,
                                 offload=layout.offload, gathered_params=gathered)

    buffers = states_of(dense, dp_cp, layout.zero_stage)  # the optimizer's flat buffers and shards alone
    states = states_of(dense, dp_cp, layout.zero_stage, largest, gather_window_params(config, layout, stage, layers))
    offloaded = offloaded_state_bytes(dense, dp_cp, layout.zero_stage, layout.offload)
    if expert_held:
        gathered = expert_held if layout.expert_zero == 3 else 0  # whole while their layer runs (upper bound)
        buffers = _add(buffers, states_of(expert_held, edp, layout.expert_zero))
        states = _add(states, states_of(expert_held, edp, layout.expert_zero, gathered=gathered))
        offloaded = _add(offloaded, offloaded_state_bytes(expert_held, edp, layout.expert_zero, layout.offload))
    activations, inflight = stage_activation_bytes(config, layout, stage, layers, assumptions, w_lags=w_lags,
                                                   schedules=schedules, step_microbatches=step_microbatches)
    workspace = workspace_bytes(config, layout, stage, assumptions, layers)
    if layout.offload == "none":  # the step's temporaries come after backward has freed the activations
        dense_shard = math.ceil(dense / dp_cp) if layout.zero_stage >= 1 else dense
        expert_shard = 0
        if expert_held:
            expert_shard = math.ceil(expert_held / edp) if layout.expert_zero >= 1 else expert_held
        # AdamW's shard-sized fp32 temporaries: every device runs torch's fused kernel (ZeroOptimizer's
        # "auto"); kernels.backend=torch's foreach update would add its sqrt(v) (not planned here).
        grad_fp32 = PrecisionBytes.for_precision(layout.precision, layout.grad_reduce_dtype).grad == 4
        step = step_temporaries(grad_fp32, "fused") * 4.0 * max(dense_shard, expert_shard)
        weight_bytes = PrecisionBytes.for_precision(layout.precision).weight
        pieces = [largest_grad_piece(dense, dp_cp, layout.zero_stage, weight_bytes)]
        if expert_held:
            pieces.append(largest_grad_piece(expert_held, edp, layout.expert_zero, weight_bytes))
        # The grad norm's temporaries (zero.clip), alive before Adam's: the larger counts.
        step = max(step, SQ_SUM_TEMPORARY_BYTES * max(pieces))
        workspace = max(workspace, step - activations)
    groups = [(dense, dp_cp, layout.zero_stage)] + ([(expert_held, edp, layout.expert_zero)] if expert_held else [])
    grad_bytes = PrecisionBytes.for_precision(layout.precision, layout.grad_reduce_dtype).grad
    workspace = max(workspace, reduce_scatter_staging_bytes(groups, grad_bytes, assumptions) - activations)
    return StageMemory(stage=stage, params=dense + expert_held, inflight=inflight, activations=activations,
                       workspace=workspace, **states, **offloaded, gathered_weights=states["weights"] - buffers["weights"],
                       gradient_in_flight=states["gradients"] - buffers["gradients"])
