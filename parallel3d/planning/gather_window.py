"""ZeRO stage 3's gather window: the dense parameters one rank of a pipeline stage holds whole at its peak.

Invariant: the units the runtime gathers at once (``parallel3d.zero.params_sharded``, ``units``): in
``microbatch`` mode the stage's root unit (final norm, plus the word embedding when it is tied), the largest unit
computing (a layer, or an untied embedding or head) and ``zero3_prefetch`` more layers; every parameter of the
stage during a step in ``step`` mode (the default with pp > 1). Only the dense layout's part (``dp_cp``): a unit's
routed experts are this rank's ``experts / ep`` only, laid out and gathered over ``edp`` at the experts' own ZeRO
stage, which ``planning.memory`` counts apart. ``planning.memory`` adds the window to the weights.
"""

from __future__ import annotations

from models.config import ModelConfig
from parallel3d.planning.layout import Layout
from parallel3d.planning.params import largest_layer_params, rank_params, stage_expert_params

__all__ = ["gather_window_params"]


def gather_window_params(config: ModelConfig, layout: Layout, stage: int, layers: int) -> int:
    """Dense parameters stage 3 holds whole at its peak on one rank of pipeline ``stage`` (module doc)."""
    if layout.zero_stage != 3:
        return 0
    rp = rank_params(config, layout.tp, layout.pp, stage, layers, layout.placement)
    if layout.zero3_mode == "step":
        return rp.total - stage_expert_params(config, layout.pp, stage, layers)[0]  # rp counts every expert whole
    layer = largest_layer_params(config, layout.tp, layers, routed_experts=False)
    if config.tie_embeddings:  # the embedding (and its copy on the last stage) live in the root
        root, own_units = rp.embedding + rp.head + rp.final_norm, [layer]
    else:  # untied embedding and head are units of their own (models.transformer marks them)
        root, own_units = rp.final_norm, [layer, rp.embedding, rp.head]
    count = layers if isinstance(layers, int) else len(layers)
    return root + max(own_units) + min(count, layout.zero3_prefetch) * layer
