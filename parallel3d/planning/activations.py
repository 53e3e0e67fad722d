"""Activation memory per transformer layer and per pipeline stage.

Per-layer bytes follow Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models" (section 4), for 16-bit activations
and 1-byte dropout masks, with s = sequence length, b = micro-batch size,
h = hidden size, a = heads, t = tensor-parallel size:

    no parallelism            s*b*h * (34 + 5*a*s/h)
    tensor parallel           s*b*h * (10 + 24/t + 5*a*s/(h*t))
    tensor + sequence par.    s*b*h/t * (34 + 5*a*s/h)
    selective recompute       the 5*a*s/h term (attention scores) is dropped
    full recompute            only the layer input, 2*s*b*h (/t with sequence parallel)

The terms are kept separately (which tensors are stored, which are split over
tp) so that the same code also covers GQA, SwiGLU, no dropout, fp32
activations and fused attention; with the paper's assumptions
(``ActivationAssumptions.korthikanti()``) it reduces exactly to the table above.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from models.config import ModelConfig
from models.spec import BlockSpec
from parallel3d.pipeline.actions import Action, split_backwards
from parallel3d.pipeline.schedules import peak_in_flight
from parallel3d.planning.layout import Layout
from parallel3d.planning.loss_bytes import (SHARDED_LOSS_TOKEN_BYTES, loss_count_bytes, loss_logit_bytes,
                                             loss_token_bytes)
from parallel3d.planning.position_bytes import position_rows, rotary_layer_bytes
from parallel3d.planning.schedule_cache import ScheduleCache
from parallel3d.planning.sequence_experts import a2a_size, kv_repeats, local_seq_len, moe_layer_activation_bytes
from parallel3d.tensor_parallel.layers import padded_vocab_size

# fp32 statistics one norm of each kind keeps per token for backward: LayerNorm mean and rstd, RMSNorm rstd.
NORM_STATS_PER_TOKEN: dict[str, int] = {"layernorm": 2, "rmsnorm": 1}
# Bytes per hidden element the torch reference norm of each kind keeps (None: one activation-dtype copy
# of its input, as the fused kernels keep): the RMSNorm reference keeps fp32 input and normalised output.
REFERENCE_NORM_KEPT_BYTES: dict[str, float | None] = {"layernorm": None, "rmsnorm": 8.0}
# Whether the torch reference norm of each kind multiplies by an fp32 copy of its weight, which it keeps for backward
# where the weight is 16-bit (``kernels.reference.rms_norm_reference``: ``weight.float()``; in fp32 the weight itself).
REFERENCE_NORM_FP32_WEIGHT: dict[str, bool] = {"layernorm": False, "rmsnorm": True}


@dataclass(frozen=True)
class ActivationAssumptions:
    """What a layer stores for backward, beyond the matmul inputs.

    The defaults are Korthikanti et al.'s GPT setting; ``for_model`` describes
    parallel3d's own layers (checked against bytes measured by the pipeline
    engine in tests/test_planning_measured.py).
    """

    element_bytes: int = 2  # activation dtype size (2 for bf16/fp16, 4 for fp32)
    hidden_dropout: bool = True  # 1-byte masks after attention, after the MLP and after the embedding
    attention_dropout: bool = True  # dropout on attention probabilities (mask + output)
    fused_attention: bool = False  # flash-style attention: keeps its output and log-sum-exp, no s x s scores
    chunk_output_kept: bool = False  # a pipeline chunk keeps its output until its backward
    # The engine frees a sent output's storage (Megatron's trick; single-chunk schedules on
    # gloo): a stage then keeps only its newest, not yet sent, output.
    sent_outputs_freed: bool = False
    # The backend reports a send complete without a blocking wait (NCCL), so interleaved schedules free
    # their sent outputs too; on gloo (the CPU path) single-chunk schedules wait for them, and the others free
    # one once a receive of its batch was waited (``pipeline.sent_release``: counted by ``split_memory``).
    sends_complete_unwaited: bool = False
    # Bytes per hidden element one norm keeps for backward; None: one activation-dtype copy
    # of its input (fused kernels). The torch RMSNorm reference keeps fp32 copies of its
    # input and of its normalised output: 8.
    norm_kept_bytes: float | None = None
    swiglu_tensors: int = 3  # [s, b, ffn] tensors SwiGLU keeps: gate, up, product (+ silu(gate) unfused)
    # Bytes per weight element a norm keeps beside its parameter (``REFERENCE_NORM_FP32_WEIGHT``: 4 for the torch
    # RMSNorm of a 16-bit model; the fused kernels save the parameter itself).
    norm_weight_copy_bytes: int = 0
    # The torch reference RoPE casts the fp32 rotary tables to the activations' dtype in every layer and keeps the
    # casts; False: the fused kernel keeps the tables (``position_bytes``).
    rope_cast_copies: bool = False
    # fp32 per-token norm statistics, per-head log-sum-exp, the embedding's saved ids, the loss's per-token tensors
    # (``loss_token_bytes``) and the step's microbatch tensors (``batch_tensors``): what the paper leaves out
    small_stats: bool = False
    # A CPU job's microbatches are the data path's own (``batch_tensors.step_batch_bytes``), not device copies.
    batch_on_host: bool = False
    # The step's microbatches carry ``data.document_mask``'s document ids (``batch_tensors.step_batch_bytes``).
    document_ids: bool = False
    # Bytes per logit the tp = 1 cross entropy keeps on the last stage (fp32 log-softmax, or the fused kernel's
    # logits in their dtype); at tp > 1 the sharded loss the model runs decides (``loss_logit_bytes``).
    logits_bytes: int = 4
    # Bytes per token the tp = 1 loss keeps beside its logits (``SHARDED_LOSS_TOKEN_BYTES`` for the fused
    # kernel; torch's none); at tp > 1 the sharded loss the model runs decides (``loss_token_bytes``).
    loss_token_bytes: int = 0
    # Logit-sized fp32 tensors alive at the loss's backward beyond the kept ones (the torch path: the
    # gradient nll_loss_backward returns and log_softmax_backward's output, both alive at once, as
    # the CPU allocator's peak shows in tests/test_planning_measured_cp.py):
    # part of the step's transient workspace, not of the activations held between forward and backward.
    logits_backward_copies: int = 0
    # torch's CPU flash attention in cp's blockwise backward (contiguous copies, repeated K/V heads;
    # sequence_experts.cp_backward_workspace_bytes); False: the Triton kernel.
    reference_attention_blocks: bool = False
    # ZeRO stage 1 reduce-scatters every gradient bucket asynchronously and waits at the end of backward;
    # gloo (the CPU backend of the reference path) reduces a copy of each bucket it allocates itself,
    # so a whole gradient buffer's copy (and the owned pieces) is alive then. NCCL: 0.
    reduce_scatter_staging_copies: int = 0
    # Whole gathered copies the collective backend allocates for a cp all-gather (gloo, the CPU
    # backend of the reference path: 1; NCCL gathers in place: 0).
    gather_staging_copies: int = 0

    @classmethod
    def korthikanti(cls) -> "ActivationAssumptions":
        """The paper's GPT setting: 16-bit activations, dropout everywhere, unfused attention."""
        return cls()

    @classmethod
    def for_model(cls, config: ModelConfig, precision: str = "bf16", kernels: str = "fused") -> "ActivationAssumptions":
        """parallel3d's layers: dropout only on hidden states, ``scaled_dot_product_attention``
        (grouped-query heads read without expansion; q, k, v kept at their own size, as in the
        paper), and with sequence parallel only the 1/t input shard of column-parallel matmuls
        kept (the paper's SP formula). ``kernels="torch"`` is the CPU reference
        path (RMSNorm keeps its output, SwiGLU keeps silu(gate)); ``"fused"`` the Triton kernels.
        """
        if kernels not in ("fused", "torch"):
            raise ValueError(f"kernels={kernels!r} is not one of ('fused', 'torch')")
        reference = kernels == "torch"
        norm = config.spec.blocks[0].norm.kind
        return cls(
            element_bytes=4 if precision == "fp32" else 2,
            hidden_dropout=config.dropout > 0,
            attention_dropout=False,
            fused_attention=True,
            chunk_output_kept=True,
            sent_outputs_freed=True,
            sends_complete_unwaited=not reference,
            norm_kept_bytes=REFERENCE_NORM_KEPT_BYTES[norm] if reference else None,
            swiglu_tensors=4 if reference else 3,
            norm_weight_copy_bytes=4 if reference and REFERENCE_NORM_FP32_WEIGHT[norm] and precision != "fp32" else 0,
            rope_cast_copies=reference,
            small_stats=True,
            # The fused cross entropy (Triton, full or vocab-sharded) keeps the logits in their own
            # dtype (plus fp32 per-row stats); torch's keeps an fp32 log-softmax.
            logits_bytes=4 if reference else (4 if precision == "fp32" else 2),
            loss_token_bytes=0 if reference else SHARDED_LOSS_TOKEN_BYTES,
            logits_backward_copies=2 if reference else 0,
            reference_attention_blocks=reference,
            reduce_scatter_staging_copies=1 if reference else 0,
            gather_staging_copies=1 if reference else 0,
        )


@dataclass(frozen=True)
class LayerActivationTerms:
    """Bytes one layer stores for one microbatch on one tp rank, by kind."""

    replicated: float  # not split over tp (split only by sequence parallel)
    sharded: float  # split over tp by heads / ffn columns (already divided by t)
    scores: float  # attention scores, split over tp by heads (already divided by t)

    @property
    def total(self) -> float:
        return self.replicated + self.sharded + self.scores


def _block(config: ModelConfig, layer: int | None = None) -> BlockSpec:
    """Global layer ``layer``'s block; without it, the block most layers have (all of them in a
    uniform model; DeepSeek-V3's MoE block, not its 3 dense first layers). The memory estimate
    names every layer (``memory.stage_activation_bytes``); per-layer callers that do not (the step
    time model) get that representative layer."""
    blocks = config.spec.blocks
    if layer is not None:
        return blocks[layer]
    if config.shape.uniform_layers:
        return blocks[0]
    return max(blocks, key=blocks.count)  # first of the most frequent (max keeps the first on ties)


def _mlp_kept_tensors(kind: str, assumptions: ActivationAssumptions) -> int:
    """``[s, b, ffn]`` tensors the MLP of ``kind`` keeps for backward: GeLU its input and output (the
    second matmul's input); SwiGLU ``assumptions.swiglu_tensors``."""
    return {"gelu": 2, "swiglu": assumptions.swiglu_tensors}[kind]


def _norm_bytes(assumptions: ActivationAssumptions) -> float:
    kept = assumptions.norm_kept_bytes
    return float(assumptions.element_bytes) if kept is None else float(kept)


def _norm_weight_copies(block: BlockSpec, assumptions: ActivationAssumptions) -> float:
    """The weight copies (``norm_weight_copy_bytes``) of a block's norms: its two pre-norms and Qwen3's q / k norms."""
    qk = block.attention.qk_norm
    return float(assumptions.norm_weight_copy_bytes * 2 * (block.norm.size + (qk.size if qk is not None else 0)))


def layer_activation_terms(
    config: ModelConfig, layout: Layout, assumptions: ActivationAssumptions, layer: int | None = None
) -> LayerActivationTerms:
    """Kept bytes of global layer ``layer`` (any layer where all are alike), one microbatch, one rank."""
    block = _block(config, layer)
    s, b, h, t = local_seq_len(layout), layout.micro_batch_size, block.hidden_size, layout.tp
    a, f, e = block.attention.num_heads, block.mlp.ffn_size, assumptions.element_bytes
    sbh = s * b * h
    if layout.recompute == "full":
        # Only the layer input is checkpointed; everything else is rebuilt in backward.
        stored = e * sbh
        return LayerActivationTerms(stored / t if layout.sequence_parallel else stored, 0.0, 0.0)
    # Two norms' saved inputs, and the QKV input and MLP input (the norms' outputs).
    norms = 2 * _norm_bytes(assumptions) * sbh
    matmul_inputs = 2 * e * sbh
    if assumptions.small_stats:
        norms += 2 * 4 * s * b * NORM_STATS_PER_TOKEN[block.norm.kind]  # fp32 statistics per token per norm
    if assumptions.hidden_dropout:
        norms += 2 * sbh  # masks of the attention and MLP residual dropouts
    replicated = norms + matmul_inputs
    if layout.sequence_parallel:
        replicated /= t
    # Whole on every rank whatever sp: the norms' weight copies and the rotary tables' casts.
    replicated += _norm_weight_copies(block, assumptions) + rotary_layer_bytes(
        config, layout, e, assumptions.rope_cast_copies, assumptions.document_ids)
    # q, k, v and the attention projection input (the attention output).
    q_k_v = block.attention.q_size + 2 * block.attention.kv_size * kv_repeats(config, layout)
    sharded = e * s * b * q_k_v + e * s * b * block.attention.q_size
    if a2a_size(layout) > 1:  # an all-to-all runs (a2a+p2p at cp_a2a_size 1 is the ring alone: fuzz case 2020)
        sharded += e * s * b * block.attention.q_size  # the output in head layout, kept by the attention
    # selective recompute reruns the attention core only where it is local (not with cp or document ids: blocks.py)
    rerun = layout.recompute == "selective" and layout.cp == 1 and not assumptions.document_ids
    if assumptions.fused_attention and assumptions.small_stats and layout.recompute != "full" and not rerun:
        sharded += 4 * a * s * b  # log-sum-exp per head and token
    if block.moe is None:
        sharded += _mlp_kept_tensors(block.mlp.kind, assumptions) * e * s * b * f
    sharded /= t
    if block.moe is not None:  # per rank already (tokens, etp, shared experts over tp)
        replicated += moe_layer_activation_bytes(block, layout, e, assumptions.swiglu_tensors)
    scores = 0.0
    if layout.recompute == "none" and not assumptions.fused_attention:
        per_score = e  # softmax output
        if assumptions.attention_dropout:
            per_score += 1 + e  # dropout mask and dropout output
        scores = per_score * a * s * layout.seq_len * b / t  # local queries x every key
    return LayerActivationTerms(replicated, sharded, scores)


def mlp_half_activation_bytes(config: ModelConfig, layout: Layout, assumptions: ActivationAssumptions,
                              layer: int | None = None) -> float:
    """Bytes of one layer's kept activations that its MLP half owns (second norm's input, the MLP's
    input and kept tensors): backward frees them before it reaches that layer's attention."""
    if layout.recompute == "full":
        return 0.0
    block = _block(config, layer)
    s, b, h, t, e = local_seq_len(layout), layout.micro_batch_size, block.hidden_size, layout.tp, \
        assumptions.element_bytes
    replicated = (_norm_bytes(assumptions) + e) * s * b * h
    if layout.sequence_parallel:
        replicated /= t
    replicated += assumptions.norm_weight_copy_bytes * block.norm.size  # the second norm's weight copy
    if block.moe is not None:
        return replicated + moe_layer_activation_bytes(block, layout, e, assumptions.swiglu_tensors)
    return replicated + _mlp_kept_tensors(block.mlp.kind, assumptions) * e * s * b * block.mlp.ffn_size / t


def layer_activation_bytes(config: ModelConfig, layout: Layout, assumptions: ActivationAssumptions,
                           layer: int | None = None) -> float:
    """Bytes one layer (global index ``layer``; any where all are alike) stores for one in-flight
    microbatch on one tp rank."""
    return layer_activation_terms(config, layout, assumptions, layer).total


def embedding_activation_bytes(config: ModelConfig, layout: Layout, assumptions: ActivationAssumptions) -> float:
    """First stage, per in-flight microbatch: the embedding-output dropout mask, and (``small_stats``) with
    tp > 1 the lookup's saved int64 shard-local ids and the bool mask of ids outside its vocabulary shard
    (``tensor_parallel.layers.vocab_parallel_embedding``; the whole local sequence: the lookup runs before
    sequence parallel's reduce-scatter), and learned positions' int64 positions. At tp 1 the lookup saves the
    microbatch's own ids, counted once per step with the step's tensors (``batch_tensors``)."""
    tokens = local_seq_len(layout) * layout.micro_batch_size
    lookup = (8 + 1) * tokens if assumptions.small_stats and layout.tp > 1 else 0.0
    if assumptions.small_stats and config.spec.learned_positions:
        # the position lookup's int64 positions (``models.gpt.Embedding``), ``position_rows`` of them: the rank's
        # sequence-parallel slice, or (cp; per-document positions) the whole local positions the slice is a view of
        sp_slice = layout.tp if layout.sequence_parallel and layout.cp == 1 and not assumptions.document_ids else 1
        lookup += 8 * position_rows(layout, assumptions.document_ids) * local_seq_len(layout) / sp_slice
    if not assumptions.hidden_dropout:
        return float(lookup)
    sbh = tokens * config.hidden_size
    return lookup + (sbh / layout.tp if layout.sequence_parallel else float(sbh))


def head_activation_bytes(config: ModelConfig, layout: Layout, assumptions: ActivationAssumptions) -> float:
    """Last stage, per in-flight microbatch: final-norm input (and, ``small_stats``, its fp32 statistics, as each
    layer's norms), head input, the loss's kept logits of the vocab shard (``loss_logit_bytes``), its per-token
    tensors (``loss_token_bytes``), the sharded loss's token count and the final norm's weight copy."""
    s, b, h = local_seq_len(layout), layout.micro_batch_size, config.hidden_size
    norm_input = _norm_bytes(assumptions) * s * b * h
    if assumptions.small_stats:
        norm_input += 4 * s * b * NORM_STATS_PER_TOKEN[config.spec.final_norm.kind]
    head_input = float(assumptions.element_bytes * s * b * h)
    norm_and_head_inputs = norm_input + head_input
    if layout.sequence_parallel:
        norm_and_head_inputs /= layout.tp
    norm_and_head_inputs += assumptions.norm_weight_copy_bytes * config.spec.final_norm.size
    local_vocab = padded_vocab_size(config.vocab_size, layout.tp) / layout.tp
    logits = loss_logit_bytes(config, layout, assumptions) * s * b * local_vocab
    count = loss_count_bytes(config, layout, assumptions)
    return norm_and_head_inputs + logits + loss_token_bytes(config, layout, assumptions) * s * b + count


def kept_chunk_outputs(layout: Layout, stage: int, inflight: int, assumptions: ActivationAssumptions) -> int:
    """How many non-final chunk outputs ``stage`` holds at its peak, with ``inflight`` chunks in flight.

    Every in-flight chunk keeps its output except the model's last chunk (it returns a
    loss); the last stage holds one such microbatch at a time (all m under GPipe). When
    the engine frees sent outputs, it waits for the sends after each forward for
    single-chunk schedules; interleaved ones free when the backend reports a send done, which
    NCCL does by itself (``sends_complete_unwaited``) and gloo only at the end of the step. Where
    outputs are freed, at most one is kept (the newest, not yet sent).
    """
    outputs = inflight
    if stage == layout.pp - 1:
        outputs -= layout.num_microbatches if layout.schedule == "gpipe" else 1
    if assumptions.sent_outputs_freed and (layout.virtual_stages == 1 or assumptions.sends_complete_unwaited):
        outputs = min(outputs, 1)
    return max(outputs, 0)


def chunk_output_bytes(config: ModelConfig, layout: Layout, assumptions: ActivationAssumptions) -> float:
    """A non-final chunk's output (the rank's cp share of the sequence), when the engine keeps it until the
    chunk's backward."""
    if not assumptions.chunk_output_kept:
        return 0.0
    return _boundary_tensor_bytes(config, layout, assumptions)


def received_input_bytes(config: ModelConfig, layout: Layout, assumptions: ActivationAssumptions,
                         has_layers: bool = True) -> float:
    """A chunk input received from another stage, per in-flight microbatch: the engine holds it until the
    chunk's backward. Counted only where no saved tensor of the layer formulas is that storage: the torch
    RMSNorm keeps fp32 copies of a 16-bit input (``REFERENCE_NORM_KEPT_BYTES``), not the input itself;
    full recompute's checkpoint (of a chunk ``has_layers``: a head-only chunk has none, its final norm runs
    as is), the fused norms and LayerNorm keep the input as it is."""
    if (layout.recompute == "full" and has_layers) or assumptions.norm_kept_bytes is None \
            or assumptions.element_bytes == 4:
        return 0.0
    return _boundary_tensor_bytes(config, layout, assumptions)


def _boundary_tensor_bytes(config: ModelConfig, layout: Layout, assumptions: ActivationAssumptions) -> float:
    """One hidden-state tensor at a chunk boundary: the rank's cp share of the sequence, its sp slice."""
    out = assumptions.element_bytes * local_seq_len(layout) * layout.micro_batch_size * config.hidden_size
    return out / layout.tp if layout.sequence_parallel else float(out)


def chunk_in_flight_moments(name: str, pp: int, m: int, v: int, stage: int, split_drain: bool = False,
                            schedules: ScheduleCache | None = None) -> frozenset[tuple[int, ...]]:
    """The stage's most-loaded moments, per local chunk: the maximal vectors (no other is >= in every
    chunk) of microbatches in flight per chunk, read off the built schedule (a (microbatch, chunk) is in
    flight from its ``F`` to its ``B``, or its ``W`` where that backward is split). The stage's activation
    peak is at one of them whatever each chunk's bytes per microbatch (an embedding- or head-only chunk,
    uneven layer counts), which the total in flight alone does not tell. ``split_drain``: ``build_schedule``'s;
    ``schedules``: the search's built schedules (``ScheduleCache``)."""
    built = ScheduleCache.of(schedules).build(name, pp, m, v, coalesced_p2p=True, split_drain=split_drain)
    return action_in_flight_moments(built[stage])


def action_in_flight_moments(actions: Sequence[Action]) -> frozenset[tuple[int, ...]]:
    """``chunk_in_flight_moments`` of one stage's already-built action list (a caller that builds it anyway,
    e.g. with the engine's own ``w_lags``, builds it once)."""
    split = split_backwards(actions)
    chunks = sorted({a.chunk for a in actions})
    live = dict.fromkeys(chunks, 0)
    seen: set[tuple[int, ...]] = set()
    for a in actions:
        if a.kind in ("F", "W") or (a.kind == "B" and (a.microbatch, a.chunk) not in split):
            live[a.chunk] += 1 if a.kind == "F" else -1
            seen.add(tuple(live[c] for c in chunks))
    return frozenset(x for x in seen if not any(y != x and all(b >= a for a, b in zip(x, y)) for y in seen))


def inflight_chunks(layout: Layout, stage: int, schedules: ScheduleCache | None = None) -> int:
    """Most (microbatch, chunk) forward passes whose activations ``stage`` holds at once.

    gpipe: all m microbatches of every chunk. 1F1B: stage i warms up with p - i
    forwards before its first backward. zb_h1: every stage holds up to p (a microbatch stays
    until its weight-gradient ``W``; the schedule's contract; ``stage_activation_bytes`` counts the
    stage's own, from its ``W`` lag, ``zb_lags``). Interleaved 1F1B (Narayanan et al.
    2021): stage i runs (p - i - 1) * 2 + (v - 1) * p warm-up forwards, then
    one more before the first backward; for the first stage that is
    p*v + p - 1 chunks, i.e. Korthikanti's factor (1 + (p - 1)/(p*v)) on L layers.
    Any other schedule (zbv) is counted on its built action list, so a schedule added to the
    runtime needs no formula here.
    """
    p, m, v = layout.pp, layout.num_microbatches, layout.virtual_stages
    if layout.schedule == "gpipe":
        return m * v
    if layout.schedule == "1f1b":
        return min(p - stage, m)
    if layout.schedule == "zb_h1":
        return min(p, m)
    if layout.schedule == "interleaved_1f1b":
        return min((p - stage - 1) * 2 + (v - 1) * p + 1, m * v)
    schedules = ScheduleCache.of(schedules)
    return peak_in_flight(schedules.build(layout.schedule, p, m, v))[stage]
