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

from models.config import ModelConfig
from parallel3d.planning.layout import Layout
from parallel3d.planning.params import padded_vocab


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
    # parallel3d's attention: q and v are views of one fused QKV buffer (a kept view keeps all
    # of it alive); k, rotary outputs and GQA expansion (keys/values repeated to every query
    # head before attention) are new tensors. False: Korthikanti's separate Q, K, V.
    fused_qkv_views: bool = False
    chunk_output_kept: bool = False  # a pipeline chunk keeps its output until its backward
    # With sequence parallel, column-parallel matmuls keep their all-gathered (full-sequence)
    # input; Korthikanti's Megatron keeps the 1/t shard and gathers it again in backward.
    sp_keeps_gathered_inputs: bool = False
    # Bytes per hidden element one norm keeps for backward; None: one activation-dtype copy
    # of its input (fused kernels). The torch RMSNorm reference keeps fp32 copies of its
    # input and of its normalised output: 8.
    norm_kept_bytes: float | None = None
    swiglu_tensors: int = 3  # [s, b, ffn] tensors SwiGLU keeps: gate, up, product (+ silu(gate) unfused)
    small_stats: bool = False  # fp32 per-token norm statistics and per-head log-sum-exp
    logits_bytes: int = 4  # cross entropy keeps fp32 logits / softmax on the last stage

    @classmethod
    def korthikanti(cls) -> "ActivationAssumptions":
        """The paper's GPT setting: 16-bit activations, dropout everywhere, unfused attention."""
        return cls()

    @classmethod
    def for_model(cls, config: ModelConfig, precision: str = "bf16", kernels: str = "fused") -> "ActivationAssumptions":
        """parallel3d's layers: dropout only on hidden states, ``scaled_dot_product_attention``,
        GQA keys/values expanded before attention. ``kernels="torch"`` is the CPU reference
        path (RMSNorm keeps its output, SwiGLU keeps silu(gate)); ``"fused"`` the Triton kernels.
        """
        if kernels not in ("fused", "torch"):
            raise ValueError(f"kernels={kernels!r} is not one of ('fused', 'torch')")
        reference = kernels == "torch"
        return cls(
            element_bytes=4 if precision == "fp32" else 2,
            hidden_dropout=config.dropout > 0,
            attention_dropout=False,
            fused_attention=True,
            fused_qkv_views=True,
            chunk_output_kept=True,
            sp_keeps_gathered_inputs=True,
            norm_kept_bytes=8.0 if reference and config.arch == "llama" else None,
            swiglu_tensors=4 if reference else 3,
            small_stats=True,
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


def _norm_bytes(assumptions: ActivationAssumptions) -> float:
    kept = assumptions.norm_kept_bytes
    return float(assumptions.element_bytes) if kept is None else float(kept)


def _qkv_elements_per_token(config: ModelConfig, recompute: str, assumptions: ActivationAssumptions) -> int:
    """Elements per token (all tp ranks) kept for the attention core's inputs q, k, v."""
    h, kv = config.hidden_size, config.kv_heads * config.head_dim
    if not assumptions.fused_qkv_views:
        return h + 2 * kv
    rotary = config.arch == "llama"
    # With selective recompute the checkpoint keeps the core's inputs before GQA expansion.
    expanded = kv < h and recompute != "selective"
    # k is always its own tensor (rotary output, or made contiguous); q only with rotary.
    copies = (h if rotary else 0) + (2 * h if expanded else kv)
    views_kept = not rotary or not expanded  # q (no rotary) or v (not expanded) is still a view
    return copies + (h + 2 * kv if views_kept else 0)


def layer_activation_terms(
    config: ModelConfig, layout: Layout, assumptions: ActivationAssumptions
) -> LayerActivationTerms:
    s, b, h, t = layout.seq_len, layout.micro_batch_size, config.hidden_size, layout.tp
    a, f, e = config.num_heads, config.ffn_size, assumptions.element_bytes
    sbh = s * b * h
    if layout.recompute == "full":
        # Only the layer input is checkpointed; everything else is rebuilt in backward.
        stored = e * sbh
        return LayerActivationTerms(stored / t if layout.sequence_parallel else stored, 0.0, 0.0)
    # Two norms' saved inputs, and the QKV input and MLP input (the norms' outputs).
    norms = 2 * _norm_bytes(assumptions) * sbh
    matmul_inputs = 2 * e * sbh
    if assumptions.small_stats:
        norms += 2 * 4 * s * b * (2 if config.arch == "gpt" else 1)  # mean/rstd per token per norm
    if assumptions.hidden_dropout:
        norms += 2 * sbh  # masks of the attention and MLP residual dropouts
    if layout.sequence_parallel:
        norms /= t
        if not assumptions.sp_keeps_gathered_inputs:
            matmul_inputs /= t
    replicated = norms + matmul_inputs
    # q, k, v and the attention projection input (the attention output).
    sharded = e * s * b * _qkv_elements_per_token(config, layout.recompute, assumptions) + e * sbh
    if assumptions.fused_attention and assumptions.small_stats and layout.recompute == "none":
        sharded += 4 * a * s * b  # log-sum-exp per head and token
    if config.arch == "gpt":
        sharded += 2 * e * s * b * f  # GeLU input and output (the second matmul's input)
    else:
        sharded += assumptions.swiglu_tensors * e * s * b * f
    sharded /= t
    scores = 0.0
    if layout.recompute == "none" and not assumptions.fused_attention:
        per_score = e  # softmax output
        if assumptions.attention_dropout:
            per_score += 1 + e  # dropout mask and dropout output
        scores = per_score * a * s * s * b / t
    return LayerActivationTerms(replicated, sharded, scores)


def layer_activation_bytes(config: ModelConfig, layout: Layout, assumptions: ActivationAssumptions) -> float:
    """Bytes one layer stores for one in-flight microbatch on one tp rank."""
    return layer_activation_terms(config, layout, assumptions).total


def embedding_activation_bytes(config: ModelConfig, layout: Layout, assumptions: ActivationAssumptions) -> float:
    """First stage, per in-flight microbatch: the embedding-output dropout mask."""
    if not assumptions.hidden_dropout:
        return 0.0
    sbh = layout.seq_len * layout.micro_batch_size * config.hidden_size
    return sbh / layout.tp if layout.sequence_parallel else float(sbh)


def head_activation_bytes(config: ModelConfig, layout: Layout, assumptions: ActivationAssumptions) -> float:
    """Last stage, per in-flight microbatch: final-norm input, head input, fp32 logits of the vocab shard."""
    s, b, h = layout.seq_len, layout.micro_batch_size, config.hidden_size
    norm_input = _norm_bytes(assumptions) * s * b * h
    head_input = float(assumptions.element_bytes * s * b * h)
    if layout.sequence_parallel:
        norm_input /= layout.tp
        if not assumptions.sp_keeps_gathered_inputs:
            head_input /= layout.tp
    norm_and_head_inputs = norm_input + head_input
    logits = assumptions.logits_bytes * s * b * padded_vocab(config, layout.tp) / layout.tp
    return norm_and_head_inputs + logits


def chunk_output_bytes(config: ModelConfig, layout: Layout, assumptions: ActivationAssumptions) -> float:
    """A non-final chunk's output, when the engine keeps it until the chunk's backward."""
    if not assumptions.chunk_output_kept:
        return 0.0
    out = assumptions.element_bytes * layout.seq_len * layout.micro_batch_size * config.hidden_size
    return out / layout.tp if layout.sequence_parallel else float(out)


def inflight_chunks(layout: Layout, stage: int) -> int:
    """Most (microbatch, chunk) forward passes whose activations ``stage`` holds at once.

    gpipe: all m microbatches of every chunk. 1F1B: stage i warms up with p - i
    forwards before its first backward. Interleaved 1F1B (Narayanan et al.
    2021): stage i runs (p - i - 1) * 2 + (v - 1) * p warm-up forwards, then
    one more before the first backward; for the first stage that is
    p*v + p - 1 chunks, i.e. Korthikanti's factor (1 + (p - 1)/(p*v)) on L layers.
    """
    p, m, v = layout.pp, layout.num_microbatches, layout.virtual_stages
    if layout.schedule == "gpipe":
        return m * v
    if layout.schedule == "1f1b":
        return min(p - stage, m)
    return min((p - stage - 1) * 2 + (v - 1) * p + 1, m * v)
