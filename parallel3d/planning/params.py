"""Parameters per rank of a (tp, pp) layout, read from the model's shape (``models.shape``).

``ModelConfig.shape`` lists every parameter with its tp sharding class; this module only
places them on pipeline stages the way ``build_model`` and the pipeline engine do: the stage
holding model chunk 0 has the embedding, the one holding the last model chunk the final norm and
head (``pipeline.placement``: the last stage in a loop, stage 0 in zbv's V), and a tied embedding
has a copy in a last chunk that is not also the first (not a new parameter of the model, but
memory on that rank). The vocabulary is padded to a multiple of tp. Cross-checked against meta-device builds
in tests.
"""

from __future__ import annotations

from typing import Sequence

from models.config import ModelConfig
from models.shape import HeldParams, ModelShape
from parallel3d.pipeline.partition import stage_layer_ranges
from parallel3d.planning.engine_split import engine_split
from parallel3d.pipeline.placement import ChunkPlacement


def stage_layer_counts(config: ModelConfig, pp: int, virtual_stages: int = 1, seq_len: int | None = None) -> list[int]:
    """Layers held by each pipeline stage, split exactly as the pipeline engine splits them: balanced by
    cost at the job's ``seq_len`` (``rank_build`` passes ``train.seq_len``; None: ``model.max_seq_len``)."""
    ranges = engine_split(config, pp, virtual_stages, seq_len)
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
    start, end = engine_split(config, pp, 1, seq_len)[stage]
    if end - start == layers:
        return range(start, end)
    blocks = config.spec.blocks
    common = blocks.index(max(blocks, key=blocks.count))
    return [common] * layers


def stage_layer_indices(config: ModelConfig, pp: int, stage: int, layers: int | Sequence[int],
                        seq_len: int | None = None) -> Sequence[int]:
    """A stage's layer indices for per-stage totals (``_stage_ids``: exact for the engine's split at ``seq_len``)."""
    return _stage_ids(config, pp, stage, layers, seq_len)


def _ends(pp: int, stage: int, placement: ChunkPlacement | None) -> tuple[bool, bool]:
    """(holds model chunk 0: the embedding, holds the last model chunk: final norm and head) for ``stage``,
    as the runtime places chunks (``placement``; None: a loop, where they are stages 0 and pp - 1)."""
    if not 0 <= stage < pp:
        raise ValueError(f"stage={stage} out of range for pp={pp}")
    place = placement or ChunkPlacement(pp)
    if place.num_stages != pp:
        raise ValueError(f"{place} does not have pp={pp} stages")
    return place.stage_of(0) == stage, place.stage_of(place.total - 1) == stage


def rank_params(config: ModelConfig, tp: int, pp: int, stage: int, layers: int | Sequence[int],
                placement: ChunkPlacement | None = None) -> HeldParams:
    """Parameters on one tp rank of pipeline ``stage``, which holds ``layers`` (a count or the indices);
    ``placement``: where the runtime puts the model chunks (``Layout.placement``; None: a loop)."""
    first, last = _ends(pp, stage, placement)
    shape, ids = config.shape, _stage_ids(config, pp, stage, layers)
    if first and last and placement is not None and placement.total > 1:  # zbv's stage 0: two chunks, two ends
        body, head = shape.held_params(tp, ids, True, False), shape.held_params(tp, (), False, True)
        return HeldParams(layers=body.layers, embedding=body.embedding, head=head.head, final_norm=head.final_norm)
    return shape.held_params(tp, ids, first, last)


def largest_tensor(config: ModelConfig, tp: int, pp: int, stage: int, layers: int | Sequence[int],
                   placement: ChunkPlacement | None = None) -> int:
    """Elements of the largest single parameter on one tp rank of a stage (its gradient is the
    transient a gradient hook holds before moving it into a main-grad buffer or shard)."""
    first, last = _ends(pp, stage, placement)
    return config.shape.largest_held_tensor(tp, _stage_ids(config, pp, stage, layers), first, last)


def _routed_expert_numel(shape: ModelShape, layer: int) -> int:
    """Elements of layer ``layer``'s routed experts, every expert whole (``ModelShape`` counts them whole)."""
    return sum(t.numel for t in shape.layers[layer].tensors if t.expert is not None)


def largest_layer_params(config: ModelConfig, tp: int, layers: int | Sequence[int], *,
                         routed_experts: bool = True) -> int:
    """Parameters of the largest of the stage's ``layers`` on one tp rank (0 without layers); without its
    routed experts (which ZeRO lays out and gathers over ``edp``, apart) when not ``routed_experts``."""
    shape = config.shape
    return max((shape.layers[i].params.per_rank(tp) - (0 if routed_experts else _routed_expert_numel(shape, i))
                for i in stage_layer_ids(shape, layers)), default=0)


def stage_expert_params(config: ModelConfig, pp: int, stage: int, layers: int | Sequence[int],
                        ep: int = 1, etp: int = 1) -> tuple[int, int]:
    """``(all, held)`` routed-expert parameters of a stage's ``layers``: every expert whole, and what one
    rank holds (``num_experts / ep`` experts, each ``1 / etp`` of its width). Zero for dense models."""
    if not 0 <= stage < pp:
        raise ValueError(f"stage={stage} out of range for pp={pp}")
    shape = config.shape
    whole = sum(_routed_expert_numel(shape, i) for i in stage_layer_ids(shape, layers))
    return whole, -(-whole // (ep * etp))
