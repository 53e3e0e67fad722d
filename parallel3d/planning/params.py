"""Analytic parameter counts: whole model, one layer, one rank's shard.

Counted from ``ModelConfig`` fields alone, following the model contract in
docs/ARCHITECTURE.md: column-parallel weights and biases (QKV, MLP up/gate) and
row-parallel weights (attention out, MLP down) are split over tp; norms and
row-parallel biases are replicated on every tp rank; the vocabulary is padded
to a multiple of tp and split; GPT positions are replicated. A GPT with pp > 1
keeps a tied copy of the word embedding on the last stage (not a new parameter
of the model, but memory on that rank). Cross-checked against
``models.count_parameters`` and meta-device builds in tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from models.config import ModelConfig
from parallel3d.pipeline.partition import partition_layers, stage_layer_ranges


def padded_vocab(config: ModelConfig, tp: int) -> int:
    """Vocabulary rounded up to a multiple of tp (each rank holds an equal slice)."""
    return math.ceil(config.vocab_size / tp) * tp


@dataclass(frozen=True)
class LayerParams:
    """Parameters of one transformer layer, split into tp-sharded and replicated parts."""

    sharded: int  # total over the tp group; each rank holds sharded / tp
    replicated: int  # held in full by every tp rank

    def per_rank(self, tp: int) -> int:
        return self.sharded // tp + self.replicated

    @property
    def total(self) -> int:
        return self.sharded + self.replicated


def layer_params(config: ModelConfig) -> LayerParams:
    h, f = config.hidden_size, config.ffn_size
    qkv_rows = (config.num_heads + 2 * config.kv_heads) * config.head_dim
    column_rows = qkv_rows + (f if config.arch == "gpt" else 2 * f)  # QKV, fc1 | gate + up
    row_inputs = config.num_heads * config.head_dim + f  # attention out, fc2 | down
    sharded = h * column_rows + row_inputs * h
    replicated = 2 * norm_params(config)
    if config.use_bias:
        sharded += column_rows  # column-parallel biases are split with their outputs
        replicated += 2 * h  # row-parallel biases are added after the reduction, so replicated
    return LayerParams(sharded, replicated)


def norm_params(config: ModelConfig) -> int:
    """LayerNorm (gpt): weight, plus bias when ``use_bias``; RMSNorm (llama): weight."""
    h = config.hidden_size
    return 2 * h if config.arch == "gpt" and config.use_bias else h


def final_norm_params(config: ModelConfig) -> int:
    return norm_params(config)


def embedding_params(config: ModelConfig, tp: int = 1) -> int:
    """Input embedding on one tp rank of the first stage (word slice + replicated positions)."""
    words = padded_vocab(config, tp) // tp * config.hidden_size
    positions = config.max_seq_len * config.hidden_size if config.arch == "gpt" else 0
    return words + positions


def head_params(config: ModelConfig, tp: int = 1) -> int:
    """Output projection on one tp rank of the last stage (0 when tied to the embedding)."""
    if config.tie_embeddings:
        return 0
    return padded_vocab(config, tp) // tp * config.hidden_size


def total_params(config: ModelConfig, tp: int = 1) -> int:
    """Parameters of the whole model (a tied embedding once), vocabulary padded for ``tp``."""
    words = padded_vocab(config, tp) * config.hidden_size
    positions = config.max_seq_len * config.hidden_size if config.arch == "gpt" else 0
    head = 0 if config.tie_embeddings else words
    return config.num_layers * layer_params(config).total + words + positions + head + final_norm_params(config)


def stage_layer_counts(config: ModelConfig, pp: int, virtual_stages: int = 1) -> list[int]:
    """Layers held by each pipeline stage, split exactly as the pipeline engine splits them."""
    ranges = partition_layers(config, pp, virtual_stages)
    return [sum(b - a for a, b in stage_layer_ranges(ranges, pp, stage)) for stage in range(pp)]


@dataclass(frozen=True)
class RankParams:
    """Parameters held by one rank of a (tp, pp) layout (dp replicas are identical)."""

    layers: int
    embedding: int
    head: int  # output projection, or the tied embedding copy on the last stage when pp > 1
    final_norm: int

    @property
    def total(self) -> int:
        return self.layers + self.embedding + self.head + self.final_norm


def rank_params(config: ModelConfig, tp: int, pp: int, stage: int, layers: int) -> RankParams:
    """Parameters on one tp rank of pipeline ``stage``, which holds ``layers`` transformer layers."""
    if not 0 <= stage < pp:
        raise ValueError(f"stage={stage} out of range for pp={pp}")
    first, last = stage == 0, stage == pp - 1
    embedding = embedding_params(config, tp) if first else 0
    head = 0
    if last:
        head = head_params(config, tp)
        if config.tie_embeddings and pp > 1:
            head = padded_vocab(config, tp) // tp * config.hidden_size  # the tied copy
    return RankParams(layers * layer_params(config).per_rank(tp), embedding, head,
                      final_norm_params(config) if last else 0)


def largest_tensor(config: ModelConfig, tp: int, first: bool, last: bool, has_layers: bool = True) -> int:
    """Elements of the largest single parameter on one tp rank of a stage (its gradient is the
    transient a gradient hook holds before moving it into a main-grad buffer or shard)."""
    h = config.hidden_size
    sizes = [0]
    if has_layers:
        qkv_rows = (config.num_heads + 2 * config.kv_heads) * config.head_dim
        sizes += [qkv_rows // tp * h, config.ffn_size // tp * h, config.num_heads * config.head_dim // tp * h]
    if first or (last and (not config.tie_embeddings or not first)):
        sizes.append(padded_vocab(config, tp) // tp * h)  # word embedding, output head or its tied copy
    if first and config.arch == "gpt":
        sizes.append(config.max_seq_len * h)
    return max(sizes)
