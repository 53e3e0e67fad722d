"""ZeRO stages 0-3 with optional optimizer-state offload (host memory or disk): flat bucketed buffers,
sharded mixed-precision AdamW, clipping, sharded checkpoints."""

from parallel3d.zero.lr_schedule import ConstantLR, WarmupCosine
from parallel3d.zero.optimizer import (
    MEMORY_CATEGORIES,
    OFFLOAD_MODES,
    RESHARD_MODES,
    ZERO_STAGES,
    StepInfo,
    ZeroOptimizer,
)
from parallel3d.zero.precision import LossScaler

__all__ = ["ConstantLR", "LossScaler", "MEMORY_CATEGORIES", "OFFLOAD_MODES", "RESHARD_MODES", "StepInfo",
           "WarmupCosine", "ZERO_STAGES", "ZeroOptimizer"]
