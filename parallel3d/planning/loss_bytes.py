"""Bytes the loss keeps for its backward, per local token and per local logit, for the loss the model runs.

Invariant: the rule deciding which loss runs is the model's own (``runs_vocab_parallel_loss``), so the planner
(``activations.head_activation_bytes``) and the model cannot disagree on it. ``assumptions`` is an
``activations.ActivationAssumptions`` (only the fields of ``LossAssumptions`` are read).
"""

from __future__ import annotations

from typing import Protocol

from models.config import ModelConfig
from parallel3d.planning.layout import Layout
from parallel3d.tensor_parallel.cross_entropy import runs_vocab_parallel_loss
from parallel3d.tensor_parallel.layers import padded_vocab_size

# Bytes per local token a loss keeps beside its logits and its targets (the targets are the step's labels,
# counted with the step's microbatch tensors, ``batch_tensors``): the kernels' sharded cross entropy
# (``ShardedCrossEntropy``, also the fused full-vocabulary one at tp 1) an fp32 log-sum-exp and a bool valid
# mask per row; the torch vocab-parallel one (``tensor_parallel.cross_entropy``) its int64 shard-local targets
# and two bool masks; torch's own cross entropy (tp 1 on the torch path) nothing beyond its log-softmax.
SHARDED_LOSS_TOKEN_BYTES = 4 + 1
# The int64 count of valid labels the sharded loss's mean divides by (``models.transformer``), kept by the division.
SHARDED_LOSS_COUNT_BYTES = 8
# The fp32 total weight torch's ``nll_loss`` keeps, its mean's divisor (torch's cross entropy: tp 1 on the torch path).
TORCH_LOSS_TOTAL_WEIGHT_BYTES = 4
# cp > 1: the fp32 factor ``[1]`` that reweights a cp share's mean loss (``models.transformer``'s ``_cp_weighted``).
CP_LOSS_WEIGHT_BYTES = 4
VOCAB_PARALLEL_LOSS_TOKEN_BYTES = 8 + 1 + 1


class LossAssumptions(Protocol):
    """The fields of ``activations.ActivationAssumptions`` the loss's bytes depend on."""

    small_stats: bool
    logits_bytes: int
    element_bytes: int
    loss_token_bytes: int


def vocab_parallel_loss(config: ModelConfig, layout: Layout) -> bool:
    """tp > 1: the torch vocab-parallel loss runs, else the kernels' sharded one (the model's own test)."""
    padded = padded_vocab_size(config.vocab_size, layout.tp)
    return runs_vocab_parallel_loss(config.backend, config.vocab_size, padded, padded // layout.tp)


def loss_logit_bytes(config: ModelConfig, layout: Layout, assumptions: LossAssumptions) -> int:
    """Bytes per local logit the loss keeps for backward. tp = 1: the assumptions' ``logits_bytes``. tp > 1:
    the sharded loss the model runs (``runs_vocab_parallel_loss``, the model's own test): the torch one keeps
    an fp32 softmax of the shard, the kernels' keeps the logits as they are, in the activation dtype, on
    every backend but ``torch`` (a CPU job's ``auto`` included, whose other ops are the torch reference's)."""
    if layout.tp == 1:
        return assumptions.logits_bytes
    if vocab_parallel_loss(config, layout):
        return 4  # fp32 softmax (``tensor_parallel.cross_entropy``)
    return assumptions.element_bytes


def loss_count_bytes(config: ModelConfig, layout: Layout, assumptions: LossAssumptions) -> int:
    """Bytes of the divisor the loss's mean keeps (only with ``small_stats``): the int64 count of valid labels of
    the kernels' losses (the sharded one at tp > 1; at tp 1 the fused one, ``kernels.cross_entropy.reduce_loss``,
    told from torch's by its per-token bytes), torch's total weight at tp 1; none counted for the torch vocab-parallel
    loss; and with cp > 1 the factor that reweights the share's mean."""
    if not assumptions.small_stats:
        return 0
    cp = CP_LOSS_WEIGHT_BYTES if layout.cp > 1 else 0
    if layout.tp == 1:
        return cp + (SHARDED_LOSS_COUNT_BYTES if assumptions.loss_token_bytes else TORCH_LOSS_TOTAL_WEIGHT_BYTES)
    return cp + (0 if vocab_parallel_loss(config, layout) else SHARDED_LOSS_COUNT_BYTES)


def loss_token_bytes(config: ModelConfig, layout: Layout, assumptions: LossAssumptions) -> int:
    """Bytes per local token the loss keeps beside its logits and targets. tp = 1: the assumptions'. tp > 1:
    the sharded loss the model runs (``runs_vocab_parallel_loss``, as ``loss_logit_bytes`` asks). Only with
    ``small_stats``."""
    if not assumptions.small_stats:
        return 0
    if layout.tp == 1:
        return assumptions.loss_token_bytes
    if vocab_parallel_loss(config, layout):
        return VOCAB_PARALLEL_LOSS_TOKEN_BYTES
    return SHARDED_LOSS_TOKEN_BYTES
