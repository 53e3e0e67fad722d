"""Megatron-style tensor-parallel layers (one code path for every tp; tp=1 is a group of one).

Shapes (``n`` = tp size, activations batch-first ``[b, s, h]``; with sequence
parallel the input/output of the replicated regions is ``[b, s/n, h]``):

- ``ColumnParallelLinear(in, out)``: weight shard ``[out/n, in]`` (``tp_split_dim=0``),
  output ``[b, s, out/n]`` (or ``[b, s, out]`` with ``gather_output``). With sequence parallel
  its input ``[b, s/n, in]`` is all-gathered in forward and again in backward, so only the
  shard is kept for backward (``gathered_linear``).
- ``RowParallelLinear(in, out)``: weight shard ``[out, in/n]`` (``tp_split_dim=1``), input
  ``[b, s, in/n]``, output summed over tp (all-reduce, or reduce-scatter along the sequence
  with sequence parallel); its bias is replicated.
- ``VocabParallelEmbedding(V, h)``: rows of the padded vocabulary ``V_pad`` (a multiple of n)
  split over tp; tokens outside a rank's rows give zeros there, and the sum over tp restores
  the full embedding.
- ``ParallelLMHead(h, V)``: a column-parallel projection to this rank's padded-vocab shard.

Every parameter carries ``global_name`` and ``tp_split_dim`` (``parallel3d.param_meta``) and is
initialised from ``(seed, global_name)`` alone (``parallel3d.tensor_parallel.init``).
Vocabulary padding rows are zero and carry ``unpadded_rows`` (the real vocabulary size).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from parallel3d.param_meta import set_meta
from parallel3d.tensor_parallel import mappings
from parallel3d.tensor_parallel.deferrable_linear import deferrable_linear
from parallel3d.tensor_parallel.gathered_linear import WeightAndBias, seq_gathered_linears
from parallel3d.tensor_parallel.init import normal_shard

if TYPE_CHECKING:  # pragma: no cover
    from parallel3d.parallel_state import ParallelState


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """The vocabulary rounded up to a multiple of ``tp`` (padding rows are zero and masked)."""
    return -(-vocab_size // tp) * tp


def _divide(value: int, tp: int, what: str) -> int:
    if value % tp:
        raise ValueError(f"{what}={value} is not divisible by tp={tp}")
    return value // tp


def _device(pstate: "ParallelState", device: torch.device | str | None) -> torch.device:
    return torch.device(device) if device is not None else pstate.device


def _parameter(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device))


def _zero_bias(out: int, *, split: bool, name: str, dtype, device) -> nn.Parameter:
    bias = _parameter((out,), dtype, device)
    if not bias.is_meta:
        with torch.no_grad():
            bias.zero_()
    return set_meta(bias, tp_split_dim=0 if split else None, global_name=name, no_weight_decay=True)


def column_parallel_linears(
    x: torch.Tensor,
    weights_and_biases: Sequence[WeightAndBias],
    pstate: "ParallelState",
    *,
    sequence_parallel: bool = False,
) -> list[torch.Tensor]:
    """``[x @ w_shard.T (+ b_shard) for (w, b)]`` with the shared input made whole on every tp rank
    once (all-gathered along the sequence with sequence parallel, which keeps only the shard
    for backward)."""
    if sequence_parallel:
        return seq_gathered_linears(x, weights_and_biases, pstate)
    x = mappings.copy_to_tp_region(x, pstate)
    return [deferrable_linear(x, w, b, pstate.weight_grads) for w, b in weights_and_biases]


def column_parallel_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    pstate: "ParallelState",
    *,
    sequence_parallel: bool = False,
    gather_output: bool = False,
) -> torch.Tensor:
    """``x @ weight_shard.T (+ bias_shard)`` with the input made whole on every tp rank first."""
    (y,) = column_parallel_linears(x, [(weight, bias)], pstate, sequence_parallel=sequence_parallel)
    return mappings.gather_last_dim(y, pstate) if gather_output else y


class _ShardedLinear(nn.Module):
    """The weight of a tp-sharded linear: ``[out, in]`` split over tp along ``split_dim``
    (0: output rows, column parallel; 1: input columns, row parallel), initialised from
    ``(seed, global_name)``. A bias is split with the output rows, else replicated."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        pstate: "ParallelState",
        *,
        split_dim: int,
        global_name: str,
        seed: int = 0,
        init_std: float = 0.02,
        bias: bool = True,
        sequence_parallel: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        tp = pstate.size("tp")
        self.pstate, self.sequence_parallel = pstate, sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        shape = [out_features, in_features]
        what = "output" if split_dim == 0 else "input"
        shape[split_dim] = _divide(shape[split_dim], tp, f"{global_name}: {what} features")
        dev = _device(pstate, device)
        self.weight = _parameter(tuple(shape), dtype, dev)
        normal_shard(self.weight, seed=seed, global_name=f"{global_name}.weight", std=init_std,
                     split_dim=split_dim, tp_rank=pstate.coord("tp"), tp_size=tp)
        set_meta(self.weight, tp_split_dim=split_dim, global_name=f"{global_name}.weight", wgrad_deferrable=True)
        self.bias = None
        if bias:
            self.bias = _zero_bias(shape[0], split=split_dim == 0, name=f"{global_name}.bias", dtype=dtype, device=dev)
            # The column-parallel bias is part of the deferrable GEMM; the row-parallel one is added
            # after the reduction, so its (cheap) gradient comes in B.
            set_meta(self.bias, wgrad_deferrable=split_dim == 0)


class ColumnParallelLinear(_ShardedLinear):
    """``y = x W^T + b`` with W's output rows split over tp; see the module docstring.

    ``options``: ``global_name`` (required), ``seed``, ``init_std``, ``bias``, ``sequence_parallel``,
    ``dtype``, ``device`` (see ``_ShardedLinear``).
    """

    def __init__(self, in_features: int, out_features: int, pstate: "ParallelState", *,
                 gather_output: bool = False, **options: Any) -> None:
        super().__init__(in_features, out_features, pstate, split_dim=0, **options)
        self.gather_output = gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return column_parallel_linear(x, self.weight, self.bias, self.pstate,
                                      sequence_parallel=self.sequence_parallel, gather_output=self.gather_output)


class RowParallelLinear(_ShardedLinear):
    """``y = x W^T + b`` with W's input columns split over tp; the partial products are summed over tp.

    ``options`` as for ``ColumnParallelLinear``.
    """

    def __init__(self, in_features: int, out_features: int, pstate: "ParallelState", *,
                 input_is_parallel: bool = True, **options: Any) -> None:
        super().__init__(in_features, out_features, pstate, split_dim=1, **options)
        self.input_is_parallel = input_is_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = mappings.split_last_dim(x, self.pstate)
        y = deferrable_linear(x, self.weight, None, self.pstate.weight_grads)
        if self.sequence_parallel:
            y = mappings.reduce_scatter_seq(y, self.pstate)
        else:
            y = mappings.reduce_from_tp_region(y, self.pstate)
        if self.bias is None:
            return y
        # With sequence parallel each rank adds the bias to its own tokens only, so the
        # replicated bias's gradient is partial: f sums it over tp in backward.
        bias = mappings.copy_to_tp_region(self.bias, self.pstate) if self.sequence_parallel else self.bias
        return y + bias


class _VocabShard(nn.Module):
    """A ``[V_pad/n, h]`` vocabulary-row shard with layout-independent init (padding rows zero)."""

    def __init__(self, vocab_size: int, hidden: int, pstate: "ParallelState", *, global_name: str,
                 seed: int = 0, init_std: float = 0.02, sequence_parallel: bool = False,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__()
        tp = pstate.size("tp")
        self.pstate, self.sequence_parallel = pstate, sequence_parallel
        self.vocab_size = vocab_size
        self.padded_vocab_size = padded_vocab_size(vocab_size, tp)
        self.local_vocab = self.padded_vocab_size // tp
        self.vocab_start = pstate.coord("tp") * self.local_vocab
        self.weight = _parameter((self.local_vocab, hidden), dtype, _device(pstate, device))
        normal_shard(self.weight, seed=seed, global_name=f"{global_name}.weight", std=init_std, split_dim=0,
                     tp_rank=pstate.coord("tp"), tp_size=tp, logical_rows=vocab_size)
        set_meta(self.weight, tp_split_dim=0, global_name=f"{global_name}.weight")
        self.weight.unpadded_rows = vocab_size


class VocabParallelEmbedding(_VocabShard):
    """Token ids ``[b, s]`` -> ``[b, s, h]`` (``[b, s/n, h]`` with sequence parallel)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_embedding(input_ids, self.weight, self.pstate, vocab_start=self.vocab_start,
                                        sequence_parallel=self.sequence_parallel)


def vocab_parallel_embedding(
    input_ids: torch.Tensor,
    weight: torch.Tensor,
    pstate: "ParallelState",
    *,
    vocab_start: int,
    sequence_parallel: bool = False,
) -> torch.Tensor:
    """Look up ids in this rank's vocabulary rows (zeros elsewhere) and sum over tp."""
    if mappings.tp_group_size(pstate) == 1:
        out = F.embedding(input_ids, weight)
        return mappings.split_seq(out, pstate) if sequence_parallel else out
    local = input_ids - vocab_start
    outside = (local < 0) | (local >= weight.shape[0])
    out = F.embedding(local.masked_fill(outside, 0), weight)
    out = out.masked_fill(outside.unsqueeze(-1), 0.0)
    if sequence_parallel:
        return mappings.reduce_scatter_seq(out, pstate)
    return mappings.reduce_from_tp_region(out, pstate)


class ParallelLMHead(_VocabShard):
    """Hidden ``[b, s(/n), h]`` -> logits of this rank's padded-vocab shard ``[b, s, V_pad/n]``."""

    def __init__(self, hidden: int, vocab_size: int, pstate: "ParallelState", **options: Any) -> None:
        super().__init__(vocab_size, hidden, pstate, **options)  # options: as for VocabParallelEmbedding
        set_meta(self.weight, wgrad_deferrable=True)  # read only by the head's (deferrable) GEMM

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return column_parallel_linear(hidden, self.weight, None, self.pstate, sequence_parallel=self.sequence_parallel)
