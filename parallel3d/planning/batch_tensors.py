"""The step's microbatch tensors on one pipeline rank, in the planner's activation estimate.

The trainer hands the engine every microbatch of the step at once (token ids, labels, sample ids; on an
accelerator copied to it before the first action), and they stay until the step ends. Invariant: counted
once per step, for all ``m`` microbatches, as the engine counts them (``pipeline.step_run``: never inside a
forward's saved bytes, whatever autograd saves of them); the keys a stage reads are ``pipeline.microbatch``'s.
``data.document_mask``'s document ids are not counted (the layout does not say; the dry run has none either).
"""

from __future__ import annotations

from parallel3d.pipeline.microbatch import TOKEN_KEYS, ids_share_step_buffer, stage_keys
from parallel3d.planning.layout import Layout
from parallel3d.planning.sequence_experts import local_seq_len

__all__ = ["step_batch_bytes"]

ID_BYTES = 8  # every microbatch tensor is int64


def step_batch_bytes(layout: Layout, stage: int, on_host: bool = False, microbatches: int | None = None) -> int:
    """Bytes of the step's microbatch tensors ``stage`` reads: ``[b, s/cp]`` token ids on the stage with the
    model's first chunk, labels on the one with its last (ZB-V: both on stage 0), ``[b]`` sample ids on all;
    each its own storage, as a device job's copies are. ``on_host``: a CPU job's, the data path's own
    (``data.batches.split_step``), views of one ``[N, s + 1]`` buffer where ``ids_share_step_buffer`` says so.
    ``microbatches``: the step's count (default: the layout's)."""
    placement = layout.placement
    held = placement.chunks_of(stage)
    token_keys = [k for k in stage_keys(0 in held, placement.total - 1 in held) if k in TOKEN_KEYS]
    rows = layout.micro_batch_size * (layout.num_microbatches if microbatches is None else microbatches)
    if on_host and token_keys and ids_share_step_buffer(layout.micro_batch_size, layout.cp):
        tokens = rows * (layout.seq_len + 1)
    else:
        tokens = rows * local_seq_len(layout) * len(token_keys)
    return ID_BYTES * (tokens + rows)
