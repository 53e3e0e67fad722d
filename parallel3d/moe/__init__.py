"""Mixture of experts with expert parallelism: one concept per module.

- ``options``: ``MoEOptions``, every option's allowed values and default;
- ``router``: ``TopKRouter`` (fp32; softmax / sigmoid; top-k, normalisation, group-limited
  routing; aux-loss-free expert bias with ``update_bias``) and ``Routing``;
- ``expert_layout``: ``ExpertLayout``, which experts (and which width slice) a rank holds;
- ``capacity``: the drop definition over the whole micro-batch (layout-independent);
- ``permutation``: token order <-> expert order (gathers only, no atomics);
- ``collectives``: all-to-all / uneven gather / reduce-scatter over explicit groups; the count
  exchange and its single device-to-host synchronisation; NCCL's async semantics emulated;
- ``dispatcher_alltoall`` (default, dropless) and ``dispatcher_allgather`` (small EP);
- ``grouped_gemm``: ``grouped_linear`` (``torch._grouped_mm`` / Triton / loop) with separable
  weight gradients; the Triton kernel is ``kernels.grouped_gemm``;
- ``experts``: ``GroupedExperts`` (SwiGLU, named by global expert index, etp slices);
- ``shared_experts``: the dense shared FFN and its sigmoid gate;
- ``load_balance``: aux (micro-batch / sequence / global) and z losses, gradient injection;
- ``metrics``: per-step load statistics, ``finish_step`` (one all-reduce + bias update);
- ``layer``: ``MoELayer`` gluing them;
- ``bench``: ``bench_dispatch_vs_experts``, dispatch time vs expert compute time.
"""

from parallel3d.moe.layer import MoELayer
from parallel3d.moe.metrics import MoELayerMetrics, MoEStepStats, finish_step
from parallel3d.moe.options import MoEOptionError, MoEOptions
from parallel3d.moe.router import Routing, TopKRouter

__all__ = ["MoELayer", "MoEOptions", "MoEOptionError", "TopKRouter", "Routing", "MoELayerMetrics", "MoEStepStats",
           "finish_step"]
