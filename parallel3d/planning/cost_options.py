"""What a training implementation overlaps or shrinks, as the cost model prices it.

Invariant: the defaults describe parallel3d's own runtime; each classmethod names the framework whose
published runs it prices, so a row's options follow its source, never the row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from parallel3d.planning.layout import Layout


# Megatron-Core's DistributedDataParallel bucket, max(4e7, 1e6 x dp) parameters (``bucket_size`` left None;
# from Megatron-LM commit 0fda386c04, 2024-04-11, "Tune DDP bucket size to improve speed at large DP counts",
# "to ensure that chunks used in NCCL ring-reduce implementations are large enough to remain bandwidth-bound
# rather than latency-bound"). Before it the bucket was a fixed 4e7 (``source_frameworks.FIXED_BUCKET_SOURCES``).
MCORE_BUCKET_PARAMS = 40e6
MCORE_BUCKET_PARAMS_PER_DP = 1e6


@dataclass(frozen=True)
class CostOptions:
    """What the training implementation overlaps or shrinks; defaults describe parallel3d."""

    # Fused (flash-style) attention keeps no s x s scores, so it moves no score bytes.
    fused_attention: bool = True
    # Send 1/tp of each activation across nodes and all-gather it over NVLink
    # (Megatron-LM's scatter/gather optimisation); sequence parallel gets this for free.
    p2p_scatter_gather: bool = False
    # ZeRO stages whose gradient reduce-scatter runs during the last backward (parallel3d: stages 2-3).
    overlapped_zero_stages: tuple[int, ...] = (2, 3)
    # Bytes per gradient element in the DP reduction (None: the precision's gradient dtype).
    dp_grad_bytes: int | None = None
    # ZeRO 1/2 parameter all-gather after the step runs behind the next step's first forward
    # (Megatron-Core's overlap_param_gather); False: exposed after the optimizer.
    overlap_param_gather: bool = False
    # Tensor-parallel all-gathers / reduce-scatters run beside the layer's GEMMs by TransformerEngine's
    # userbuffers (Megatron-Core's --tp-comm-overlap), priced by ``tp_overlap``.
    tp_comm_overlap: bool = False
    # What ``recompute: selective`` recomputes: "attention" (Korthikanti et al.'s scores, as parallel3d
    # and Megatron do) or "alternate_matmuls" (torchtitan's per-op policy: every second matmul of a
    # layer, the flash attention's output kept; ``gemm.alternate_matmul_seconds``).
    selective_recompute: str = "attention"
    # Gradient buckets of the DP reduction, as (fewest parameters, parameters per DP rank). Each bucket is
    # one collective call, paying NCCL's ring latency (``CommModel.ring_latency``); overlapped, a bucket's
    # reduce-scatter starts once all its gradients exist, so the last bucket (the first layers, the
    # embedding on stage 0) runs after the backward, and the parameter all-gather of the first bucket
    # before the forward, whatever else overlaps. None: parallel3d's own buckets
    # (``grad_buckets.bucket_count``), with no bucket floor priced.
    grad_bucket: tuple[float, float] | None = None
    # Each chunk's overlapped reduction starts at its own last backward and its all-gather ends by its own
    # first forward (``dp_overlap``), as parallel3d's engine runs it (``grad_sync.prepare``); False: the
    # stage's whole traffic overlaps one chunk's pass only.
    chunk_grad_sync: bool = True
    # Only the first pipeline stage's first model chunk is cut into ``grad_bucket`` buckets; every other chunk
    # is one bucket, one collective call (Megatron-Core's DistributedDataParallel, core_r0.8.0-r0.11.0 and
    # before: bucket_size None on pipeline ranks > 0, "not on the critical path", and disable_bucketing for
    # model chunks > 0). False: every chunk is bucketed.
    bucket_first_chunk_only: bool = False
    # ZeRO-3 gathers and reduce-scatters each gather unit (a layer) in one collective call each way (FSDP2's
    # ``fully_shard`` per block: torchtitan). False: parallel3d's runtime, one call per gradient bucket, a
    # bucket never spanning two units (``grad_buckets.unit_bucket_count``).
    zero3_unit_calls: bool = False
    # The implementation runs the layout's ``parallel.split_drain`` (``Layout.splits_drain``: 1F1B's drain
    # backwards split, parallel3d's default); False: it has no such option, every 1F1B is plain (Megatron,
    # torchtitan), whatever the layout says. ``runs`` applies it to time and memory alike.
    split_drain: bool = True

    # A tied word embedding (pp > 1) has its gradient summed over the first and last stage after the DP
    # reduction, unoverlapped: parallel3d's ZeRO sums only the rank's reduced piece (``zero.grad_sync``
    # ``finalize``; without ZeRO the whole gradient, ``pipeline.tied``), Megatron-LM (2021 ``train_step``,
    # Megatron-Core ``finalize_model_grads._allreduce_word_embedding_grads``) the whole ``main_grad`` at any
    # ZeRO stage: True.
    tied_grad_whole: bool = False

    def runs(self, layout: Layout) -> Layout:
        """``layout`` as this implementation runs it: its drain kept whole where the implementation
        cannot split it (``split_drain``)."""
        return layout if self.split_drain or not layout.splits_drain else layout.replace(split_drain=False)

    @classmethod
    def megatron_core(cls) -> "CostOptions":
        """Megatron-Core (2024) recipes: fused attention, distributed optimizer with the gradient
        reduce-scatter overlapped with the last backward and the parameter all-gather with the first
        forward (overlap_grad_reduce / overlap_param_gather), bf16 gradient reduction."""
        # chunk_grad_sync=False: Megatron-Core also launches each chunk's reduction at its last backward
        # (schedules.py grad_sync_func), but priced so, the r0.8 README rows whose unstated vp the validation
        # completes at 14-16 chunks run +12 to +19% (at vp 1: -5 to -7%); kept at one chunk's overlap until
        # that completion is settled (docs/planner.md, "Data-parallel pricing, tried").
        return cls(overlapped_zero_stages=(1, 2, 3), overlap_param_gather=True, dp_grad_bytes=2,
                   grad_bucket=(MCORE_BUCKET_PARAMS, MCORE_BUCKET_PARAMS_PER_DP),
                   chunk_grad_sync=False, split_drain=False, tied_grad_whole=True, bucket_first_chunk_only=True)

    @classmethod
    def megatron_sc21(cls) -> "CostOptions":
        """Megatron-LM as Narayanan et al. 2021 ran it: unfused attention, scatter/gather P2P, gradients
        all-reduced after the backward, unoverlapped, in fp16 (the param dtype; fp32 only if bf16 forces it)."""
        # grad_bucket: one call for the whole buffer (2021 ``DistributedDataParallel.allreduce_gradients``:
        # one ``all_reduce`` per contiguous gradient buffer, i.e. per dtype), and one buffer per model chunk: each
        # interleaved chunk is its own LocalDDP, all-reduced in turn by ``train_step`` (``for model_module in
        # model``), which ``bucket_first_chunk_only`` with an unbounded bucket prices as one call per chunk.
        return cls(fused_attention=False, p2p_scatter_gather=True, overlapped_zero_stages=(), dp_grad_bytes=2,
                   grad_bucket=(math.inf, 0.0), bucket_first_chunk_only=True, split_drain=False, tied_grad_whole=True)
