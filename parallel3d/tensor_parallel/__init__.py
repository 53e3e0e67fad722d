"""Tensor parallelism: Megatron-style parallel layers, f/g communication ops, sequence
parallelism, vocabulary-parallel cross entropy and layout-independent initialisation."""

from parallel3d.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from parallel3d.tensor_parallel.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_parallel_linear,
    column_parallel_linears,
    padded_vocab_size,
    vocab_parallel_embedding,
)
from parallel3d.tensor_parallel.mappings import (
    copy_to_tp_region,
    gather_last_dim,
    gather_seq,
    reduce_from_tp_region,
    reduce_scatter_seq,
    split_last_dim,
    split_seq,
)

__all__ = [
    "ColumnParallelLinear",
    "ParallelLMHead",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "column_parallel_linear",
    "column_parallel_linears",
    "copy_to_tp_region",
    "gather_last_dim",
    "gather_seq",
    "padded_vocab_size",
    "reduce_from_tp_region",
    "reduce_scatter_seq",
    "split_last_dim",
    "split_seq",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_embedding",
]
