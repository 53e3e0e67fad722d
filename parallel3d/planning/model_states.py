"""The device and offloaded bytes of one rank's model states: weights, gradients, master weights, moments.

They follow the ZeRO paper's arithmetic (Rajbhandari et al. 2020, section 3 and Figure 1): with mixed
precision and Adam a parameter costs 2 bytes of 16-bit weight + 2 bytes of 16-bit gradient + K = 12 bytes
of fp32 master weight and two moments. ZeRO stage 1 divides the K bytes by dp, stage 2 also the
gradients, stage 3 also the weights, plus the gather window (the units whole at once,
``planning.gather_window``, which the caller passes). Offload moves the K bytes off the device: to host
memory (``cpu``) or disk (``disk``), reported as ``host`` / ``disk`` beside the device total.
``PrecisionBytes.for_precision`` has the per-precision byte counts parallel3d's ZeRO optimizer uses:
gradients are fp32 main grads (4 bytes) unless ``parallel.grad_reduce_dtype`` is the 16-bit precision,
which is the paper's 2 bytes. Invariant: pure functions of counts and options (no model, no layout).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class PrecisionBytes:
    """Bytes per parameter of each model state."""

    weight: int
    grad: int
    master: int  # fp32 copy kept by the optimizer (0 when the weights are already fp32)
    moments: int  # Adam's two fp32 moments

    @classmethod
    def for_precision(cls, precision: str, grad_reduce_dtype: str = "fp32") -> "PrecisionBytes":
        if grad_reduce_dtype not in ("fp32", precision):
            raise ValueError(f"parallel.grad_reduce_dtype={grad_reduce_dtype!r} must be fp32 or {precision!r}")
        grad = 4 if grad_reduce_dtype == "fp32" else 2
        if precision in ("bf16", "fp16"):
            return cls(weight=2, grad=grad, master=4, moments=8)
        if precision == "fp32":
            return cls(weight=4, grad=4, master=0, moments=8)
        raise ValueError(f"train.precision={precision!r} is not one of ('bf16', 'fp16', 'fp32')")

    @property
    def optimizer(self) -> int:
        """The ZeRO paper's K (12 for mixed-precision Adam)."""
        return self.master + self.moments


def model_state_bytes(
    params: int, dp: int, zero_stage: int, precision: str, grad_reduce_dtype: str = "fp32",
    largest_param: int = 0, *, offload: str = "none", gathered_params: int = 0,
) -> dict[str, float]:
    """Device bytes of weights, gradients, master weights and moments for ``params`` parameters on one rank.

    ZeRO shards the flat buffer into dp equal (padded) pieces, hence the ceil.
    parallel3d's stages 2-3 reduce-scatter every microbatch's gradients into the
    shard, so at any point of the step only the shard (plus bucket staging
    buffers, not counted here) holds gradients. Where autograd's ``.grad`` is not
    itself a view of the gradient buffer (stages 2-3, or fp32 main grads of a 16-bit
    model), the gradient a hook is moving (at most ``largest_param`` elements in the
    weights' dtype) is counted on top. Stage 3 holds the weight shard plus
    ``gathered_params`` whole parameters (the gather window). With ``offload`` the
    master weights and moments are not on the device (``offloaded_state_bytes``).
    """
    pb = PrecisionBytes.for_precision(precision, grad_reduce_dtype)
    shard = math.ceil(params / dp)
    opt_params = shard if zero_stage >= 1 else params
    grad_params = shard if zero_stage >= 2 else params
    weight_params = shard + gathered_params if zero_stage >= 3 else params
    transient = pb.weight * largest_param if zero_stage >= 2 or pb.grad != pb.weight else 0
    on_device = offload == "none"
    return {
        "weights": float(pb.weight * weight_params),
        "gradients": float(pb.grad * grad_params + transient),
        "master_weights": float(pb.master * opt_params) if on_device else 0.0,
        "optimizer_moments": float(pb.moments * opt_params) if on_device else 0.0,
    }


def offloaded_state_bytes(params: int, dp: int, zero_stage: int, offload: str) -> dict[str, float]:
    """Host and disk bytes of offloaded optimizer state on one rank: an fp32 master (always a separate
    copy when offloaded) and two fp32 moments of the shard; host staging buffers are not counted."""
    shard = math.ceil(params / dp) if zero_stage >= 1 else params
    state = 12.0 * shard
    return {"host": state if offload == "cpu" else 0.0, "disk": state if offload == "disk" else 0.0}
