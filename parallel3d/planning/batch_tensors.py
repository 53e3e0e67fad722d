"""The step's microbatch tensors on one pipeline rank, in the planner's activation estimate.

The trainer hands the engine every microbatch of the step at once (token ids, labels, sample ids, with
``data.document_mask`` document ids; on an accelerator copied to it before the first action), and they stay until
the step ends. Invariant: counted once per step, for all ``m`` microbatches, as the engine counts them
(``pipeline.step_run``: never inside a forward's saved bytes, whatever autograd saves of them); the keys a stage
reads are ``pipeline.microbatch``'s, their shapes its ``key_shape``.
"""

from __future__ import annotations

from math import prod

from parallel3d.pipeline.microbatch import (DOCUMENT_IDS, TOKEN_KEYS, ids_share_step_buffer, key_shape, stage_keys,
                                             with_documents)
from parallel3d.planning.layout import Layout

__all__ = ["step_batch_bytes"]

ID_BYTES = 8  # every microbatch tensor is int64


def step_batch_bytes(layout: Layout, stage: int, on_host: bool = False, microbatches: int | None = None,
                     documents: bool = False) -> int:
    """Bytes of the step's microbatch tensors ``stage`` reads: token ids on the stage with the model's first
    chunk, labels on the one with its last (ZB-V: both on stage 0), sample ids on all, and with ``documents``
    (``data.document_mask``) document ids on all; each its own storage, as a device job's copies are (and a
    document id tensor always: ``data.batches.split_step`` makes one per microbatch). ``on_host``: a CPU job's,
    the data path's own (``data.batches.split_step``), whose token ids and labels are views of one ``[N, s + 1]`` buffer
    where ``ids_share_step_buffer`` says so. ``microbatches``: the step's count (default: the layout's)."""
    placement = layout.placement
    held = placement.chunks_of(stage)
    keys = with_documents(stage_keys(0 in held, placement.total - 1 in held), documents)
    m = layout.num_microbatches if microbatches is None else microbatches
    b = layout.micro_batch_size

    def numel(key: str) -> int:
        return prod(key_shape(key, b, layout.seq_len, layout.cp))

    shared = [k for k in keys if k in TOKEN_KEYS and k != DOCUMENT_IDS]  # the data path's token rows
    if on_host and shared and ids_share_step_buffer(b, layout.cp):
        tokens = m * b * (layout.seq_len + 1)
    else:
        tokens = m * sum(numel(k) for k in shared)
    return ID_BYTES * (tokens + m * sum(numel(k) for k in keys if k not in shared))
