"""Time of one transformer layer (forward, backward) for one microbatch on one tensor-parallel rank.

Invariant: ``fwd + bwd`` is the layer's compute plus the communication it exposes; ``comm`` lists
that exposed part by kind ("tp", "cp", "ep"), so the step breakdown can split it off. The terms are
described in ``cost``'s module docstring.
"""

from __future__ import annotations

from dataclasses import dataclass

from models.config import ModelConfig
from models.shape import LayerFlops
from parallel3d.planning.activations import ActivationAssumptions, layer_activation_terms
from parallel3d.planning.cluster import ClusterSpec
from parallel3d.planning.comm_cost import CommModel, cp_times, ep_time
from parallel3d.planning.cost_options import CostOptions
from parallel3d.planning.gemm import (FLASH_BACKWARD_FACTOR, GemmCurve, alternate_matmul_seconds, attention_seconds,
                                     matmul_seconds)
from parallel3d.planning.layout import Layout
from parallel3d.planning.tp_overlap import tp_overlap_exposed

# The cost model counts attention over the full s x s product (QK^T and PV), as Megatron-LM's
# formula does (Narayanan et al. 2021, eq. 3), whose published TFLOP/s the planner is checked against.
COST_ATTENTION = "full"


def layer_forward_flops(config: ModelConfig, micro_batch_size: int, seq_len: int) -> LayerFlops:
    """Forward FLOPs of one layer for one microbatch (all tp ranks), from ``models.shape``: the
    mean over the layers (every layer's, for a model whose layers are alike)."""
    tokens = micro_batch_size * seq_len
    layers = config.shape.layers_forward_flops(seq_len, COST_ATTENTION)
    return LayerFlops(layers.matmul * tokens / config.num_layers, layers.attention * tokens / config.num_layers)


@dataclass(frozen=True)
class LayerTimes:
    fwd: float
    bwd: float  # includes recomputation
    # Exposed communication inside fwd + bwd of one layer, by kind ("tp", "cp", "ep"); the rest is compute.
    comm: tuple[tuple[str, float], ...] = ()


def layer_times(config: ModelConfig, layout: Layout, cluster: ClusterSpec, comm: CommModel,
                options: CostOptions) -> LayerTimes:
    dev, t = cluster.device, layout.tp
    curve = GemmCurve.of(dev)
    layer = layer_forward_flops(config, layout.micro_batch_size, layout.seq_len)
    c = layout.cp  # load-balanced context parallelism: each rank holds seq_len / cp tokens
    mm_t = matmul_seconds(config, curve, tp=t, cp=c, ep=layout.ep, etp=layout.etp,
                          micro_batch_size=layout.micro_batch_size, seq_len=layout.seq_len)
    # Every model here is a causal decoder: a fused kernel skips the masked blocks, unfused
    # attention (Narayanan et al. 2021) computes the whole product.
    att_curve = GemmCurve.fused_attention_of(dev) if options.fused_attention else curve
    att_t = attention_seconds(config, att_curve, layer.attention / (t * c), cp=c, seq_len=layout.seq_len,
                              causal_skip=options.fused_attention)
    att_bwd = (FLASH_BACKWARD_FACTOR if options.fused_attention else 2.0) * att_t
    assumptions = ActivationAssumptions(
        element_bytes=4 if layout.precision == "fp32" else 2,
        hidden_dropout=config.dropout > 0 or not options.fused_attention,
        attention_dropout=not options.fused_attention,
        fused_attention=options.fused_attention,
    )
    # Activation bytes of the whole sequence, then this rank's 1/cp share (the estimator's own cp
    # handling is for memory; the traffic here is per token either way).
    stored = layer_activation_terms(config, layout.replace(recompute="none", cp=1, cp_comm="p2p", cp_a2a_size=None),
                                    assumptions)
    elem_t = 2.0 * (stored.replicated + stored.sharded) / dev.hbm_bytes_per_s / c
    score_t = 2.0 * stored.scores / dev.hbm_bytes_per_s / c
    e = assumptions.element_bytes
    act_bytes = e * layout.micro_batch_size * layout.seq_len * config.hidden_size / c
    tp_f = tp_b = 2 * comm.all_reduce(act_bytes, "tp")  # each direction: 2 all-gathers + 2 reduce-scatters
    if options.tp_comm_overlap:
        if dev.compute_units is None:
            raise ValueError(f"device {dev.name!r}: compute_units (SMs per GPU) unknown; the TP comm overlap's "
                             f"price needs it (set it in the device's YAML)")
        tp_f, tp_b = tp_overlap_exposed(tp_f / 4, 2, config, curve, tp=t, cp=c, sms=dev.compute_units,
                                        micro_batch_size=layout.micro_batch_size, seq_len=layout.seq_len)
    cp_f, cp_b = cp_times(config, layout, comm, att_t, e)
    ep_t = ep_time(config, layout, comm, act_bytes)
    ovh = dev.layer_overhead_s
    fwd = mm_t + att_t + elem_t + score_t + ovh + tp_f + cp_f + ep_t
    bwd = 2 * (mm_t + elem_t + score_t + ovh) + att_bwd + tp_b + cp_b + ep_t
    comm = {"tp": tp_f + tp_b, "cp": cp_f + cp_b, "ep": 2 * ep_t}
    if layout.recompute == "full":
        bwd += fwd
        comm = {"tp": 2 * tp_f + tp_b, "cp": 2 * cp_f + cp_b, "ep": 3 * ep_t}
    elif layout.recompute == "selective" and options.selective_recompute == "alternate_matmuls":
        bwd += alternate_matmul_seconds(config, curve, tp=t, cp=c, ep=layout.ep, etp=layout.etp,
                                        micro_batch_size=layout.micro_batch_size, seq_len=layout.seq_len)
    elif layout.recompute == "selective":
        bwd += att_t + score_t + cp_f
        comm["cp"] += cp_f
    return LayerTimes(fwd, bwd, tuple(comm.items()))
