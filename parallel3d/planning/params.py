"""Parameters per rank of a (tp, pp) layout, read from the model's shape (``models.shape``).

``ModelConfig.shape`` lists every parameter with its tp sharding class; this module only
places them on pipeline stages the way ``build_model`` and the pipeline engine do: the first
stage holds the embedding, the last the final norm and head, and a tied embedding has a copy
on a last stage that is not also first (not a new parameter of the model, but memory on that
rank). The vocabulary is padded to a multiple of tp. Cross-checked against meta-device builds
in tests.
"""

from __future__ import annotations

from typing import Sequence

from models.config import ModelConfig
from models.shape import HeldParams, ModelShape
from parallel3d.pipeline.partition import partition_layers, stage_layer_ranges


def stage_layer_counts(config: ModelConfig, pp: int, virtual_stages: int = 1, seq_len: int | None = None) -> list[int]:
    """Layers held by each pipeline stage, split exactly as the pipeline engine splits them: balanced by
    cost at the job's ``seq_len`` (``rank_build`` passes ``train.seq_len``; None: ``model.max_seq_len``)."""
    ranges = partition_layers(config, pp, virtual_stages, seq_len=seq_len)
    return [sum(b - a for a, b in stage_layer_ranges(ranges, pp, stage)) for stage in range(pp)]


def stage_layer_ids(shape: ModelShape, layers: int | Sequence[int]) -> Sequence[int]:
    """The global indices of a stage's layers: given, or (a count) any ``layers`` of them, which
    only a model whose layers all have the same block allows."""
    if not isinstance(layers, int):
        return layers
    if not shape.uniform_layers:
        raise ValueError("this model's layers differ (models.shape): pass the stage's layer indices, not a count")
    return range(layers)


def _stage_ids(config: ModelConfig, pp: int, stage: int, layers: int | Sequence[int],
               seq_len: int | None = None) -> Sequence[int]:
    """``stage_layer_ids`` for callers that give a count on a model whose layers differ: the stage's
    own layers where the count is the engine's single-chunk split, else ``layers`` copies of the
    most common layer (an approximation for per-stage totals; pass indices to be exact)."""
    shape = config.shape
    if not isinstance(layers, int) or shape.uniform_layers:
        return stage_layer_ids(shape, layers)
    start, end = partition_layers(config, pp, 1, seq_len=seq_len)[stage]
    if end - start == layers:
        return range(start, end)
    blocks = config.spec.blocks
    common = blocks.index(max(blocks, key=blocks.count))
    return [common] * layers


def stage_layer_indices(config: ModelConfig, pp: int, stage: int, layers: int | Sequence[int],
                        seq_len: int | None = None) -> Sequence[int]:
    """A stage's layer indices for per-stage totals (``_stage_ids``: exact for the engine's split at ``seq_len``)."""
    return _stage_ids(config, pp, stage, layers, seq_len)


def rank_params(config: ModelConfig, tp: int, pp: int, stage: int, layers: int | Sequence[int]) -> HeldParams:
    """Parameters on one tp rank of pipeline ``stage``, which holds ``layers`` (a count or the indices)."""
    if not 0 <= stage < pp:
        raise ValueError(f"stage={stage} out of range for pp={pp}")
    return config.shape.held_params(tp, _stage_ids(config, pp, stage, layers), stage == 0, stage == pp - 1)


def largest_tensor(config: ModelConfig, tp: int, pp: int, stage: int, layers: int | Sequence[int]) -> int:
    """Elements of the largest single parameter on one tp rank of a stage (its gradient is the
    transient a gradient hook holds before moving it into a main-grad buffer or shard)."""
    return config.shape.largest_held_tensor(tp, _stage_ids(config, pp, stage, layers), stage == 0, stage == pp - 1)


def largest_layer_params(config: ModelConfig, tp: int, layers: int | Sequence[int]) -> int:
    """Parameters of the largest of the stage's ``layers`` on one tp rank (0 without layers)."""
    shape = config.shape
    return max((shape.layers[i].params.per_rank(tp) for i in stage_layer_ids(shape, layers)), default=0)


def stage_expert_params(config: ModelConfig, pp: int, stage: int, layers: int | Sequence[int],
                        ep: int = 1, etp: int = 1) -> tuple[int, int]:
    """``(all, held)`` routed-expert parameters of a stage's ``layers``: every expert whole, and what one
    rank holds (``num_experts / ep`` experts, each ``1 / etp`` of its width). Zero for dense models."""
    if not 0 <= stage < pp:
        raise ValueError(f"stage={stage} out of range for pp={pp}")
    shape = config.shape
    whole = sum(t.numel for i in stage_layer_ids(shape, layers) for t in shape.layers[i].tensors
                if t.expert is not None)
    return whole, -(-whole // (ep * etp))
