"""Bytes the position encodings keep for backward, per microbatch: the rotary tables and their copies.

The model builds rotary ``cos`` and ``sin`` once per chunk forward (``models.llama.rotary_tables``: fp32
``[s_local, d/2]`` each, ``d`` the rotary width ``ModelConfig.rope_dim``; ``models.transformer``), and with
``data.document_mask`` gathers them at per-document positions, one row of tables per sequence (``[b, s_local,
d/2]``: positions restart at each document, ``ContextParallelAttention.positions``). Every layer reads the same
tables. Invariant: what is kept is what autograd saves (the engine's saved-tensor count): the fused kernel saves
the tables themselves (``kernels.rope.RoPEFunction``), once per chunk forward however many layers read them; the
torch reference casts them to the activations' dtype in every call (``kernels.reference.apply_rope_reference``),
which is the fp32 tables themselves in fp32, and in 16-bit four new ``[rows, s_local, d/2]`` copies per layer
(cos and sin for q, again for k), the tables then saved by none. Under full recompute a layer saves none of them:
the checkpoint keeps the tables only inside the non-tensor ``ForwardContext`` it replays, which no saved-tensor
count sees (a few KiB a microbatch on real shapes; not counted on either side).
"""

from __future__ import annotations

from models.config import ModelConfig
from parallel3d.planning.layout import Layout
from parallel3d.planning.sequence_experts import local_seq_len

__all__ = ["TABLE_BYTES", "position_rows", "rotary_chunk_bytes", "rotary_layer_bytes"]

TABLE_BYTES = 4  # rotary_tables' dtype: float32


def position_rows(layout: Layout, documents: bool) -> int:
    """Rows of a microbatch's positions (and rotary tables): one per sequence where ``data.document_mask``
    restarts them at each document (``documents``), else one for the whole microbatch."""
    return layout.micro_batch_size if documents else 1


def _table_elements(config: ModelConfig, layout: Layout, documents: bool) -> int:
    """Elements of one of ``cos`` / ``sin`` as the layers read them: ``[rows, s_local, d/2]``."""
    return position_rows(layout, documents) * local_seq_len(layout) * config.rope_dim // 2


def rotary_chunk_bytes(config: ModelConfig, layout: Layout, element_bytes: int, cast_copies: bool,
                       documents: bool) -> float:
    """Per microbatch, per chunk forward that runs a layer: the fp32 ``cos`` and ``sin`` where a layer saves them
    (the fused kernel; the torch reference in fp32, whose cast is a view), once for all of the chunk's layers.
    ``cast_copies``: the torch reference's RoPE (``ActivationAssumptions.rope_cast_copies``)."""
    if not config.spec.rotary or layout.recompute == "full" or (cast_copies and element_bytes != TABLE_BYTES):
        return 0.0
    return 2.0 * TABLE_BYTES * _table_elements(config, layout, documents)


def rotary_layer_bytes(config: ModelConfig, layout: Layout, element_bytes: int, cast_copies: bool,
                       documents: bool) -> float:
    """Per microbatch, per layer (not under full recompute): the torch reference's 16-bit copies of ``cos``
    and ``sin``, one pair for q and one for k (0 where the layer saves the fp32 tables themselves)."""
    if not config.spec.rotary or layout.recompute == "full" or not cast_copies or element_bytes == TABLE_BYTES:
        return 0.0
    return 4.0 * element_bytes * _table_elements(config, layout, documents)
