"""How long zb_h1's ``W``s may trail on each stage so that no stage holds more than 1F1B's peak.

``zero_bubble.zb_h1_lags`` picks the lags from per-microbatch bytes; this module supplies those
bytes from the model shape, with the same formulas the memory estimate uses
(``planning.activations``): a microbatch whose ``B`` is pending keeps its layers' activations
(``A_s``; plus the embedding's on the first stage and the head's on the last), one whose ``W`` is
pending keeps about what its layers save without recompute (a layer saves about its linears' inputs
and outputs, which is what its ``W`` reads, whatever the recompute) plus, on the last stage, the
head's input and vocab-wide logits gradient. So the last stage, whose ``W`` waits hold that
gradient, trails less when the vocabulary is large against the hidden size.

Invariant: every caller that builds a zb_h1 schedule for ``(config, layout)`` (the engine through
the trainer, the dry run and the bench; the memory estimate and the step price) gets the same
lags: they depend on the model shape and the layout only, always with the default (fused-kernel)
activation assumptions and the engine's default layer split.
"""

from __future__ import annotations

from dataclasses import replace

from models.config import ModelConfig
from parallel3d.pipeline.partition import stage_layer_ranges
from parallel3d.planning.engine_split import engine_split
from parallel3d.pipeline.zero_bubble import zb_h1_lags
from parallel3d.planning.activations import (
    ActivationAssumptions,
    embedding_activation_bytes,
    head_activation_bytes,
    layer_activation_bytes,
)
from parallel3d.planning.layout import Layout
from parallel3d.planning.sequence_experts import local_seq_len
from parallel3d.tensor_parallel.layers import padded_vocab_size

__all__ = ["head_weight_grad_input_bytes", "zb_h1_w_lags"]


def head_weight_grad_input_bytes(config: ModelConfig, layout: Layout, assumptions: ActivationAssumptions) -> float:
    """What the head's deferred ``W`` keeps per microbatch (``zero_bubble.pending_at_forwards``: how many wait):
    dlogits (activation dtype, the vocab shard) and the head's input (the local shard under sequence parallel)."""
    s, b = local_seq_len(layout), layout.micro_batch_size
    logits = s * b * padded_vocab_size(config.vocab_size, layout.tp) / layout.tp
    head_input = s * b * config.hidden_size / (layout.tp if layout.sequence_parallel else 1)
    return float(assumptions.element_bytes * (logits + head_input))


def zb_h1_w_lags(config: ModelConfig, layout: Layout) -> tuple[int, ...]:
    """Per stage, how many microbatches zb_h1's ``W``s trail its ``B``s (``build_schedule(w_lags=...)``)."""
    p = layout.pp
    assumptions = ActivationAssumptions.for_model(config, layout.precision)
    ranges = engine_split(config, p, 1, layout.seq_len)
    ids = [[i for a, b in stage_layer_ranges(ranges, p, s) for i in range(a, b)] for s in range(p)]

    def layers(lay: Layout) -> list[float]:
        return [sum(layer_activation_bytes(config, lay, assumptions, i) for i in stage) for stage in ids]

    # A W wait keeps the linears' inputs and output gradients whatever the recompute: about what a layer
    # saves without recompute, while B-pending forwards save what the recompute leaves.
    held, waiting = layers(layout), layers(replace(layout, recompute="none"))
    held[0] += embedding_activation_bytes(config, layout, assumptions)
    held[-1] += head_activation_bytes(config, layout, assumptions)
    waiting[-1] += head_weight_grad_input_bytes(config, layout, assumptions)
    return zb_h1_lags(p, layout.num_microbatches, held, waiting)

